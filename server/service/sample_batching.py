"""Sample requests queued together decode together, in order with everything else.

The scheduler runs a sample job at its lane's turn together with the sample jobs queued right
behind it in that lane that read the same weights (the live ones, one export, or the base
model): one decode (``TrainingSession.sample_many``). While it decodes, a sample queued behind
it joins at the next step, as long as no other job was queued meanwhile (the scheduler's
``epoch``). So a read never sees weights older than a call queued before it, training calls keep
their order and run exactly once, and a training call queued while a batch decodes waits for
the rows that were already there plus at most the one decode step under way.

What a request draws does not depend on its company (``batch_decode``), and what it asks about
its samples and prompt beyond the draws (top-k and target logprobs) is scored for it alone after
its draws, so batching changes no result and requests asking for different logprobs decode
together.

Samples of several runs decode as one batch too (``decode_batch`` of a batch of several runs,
``together.sampling``): the base once per step over every run's rows, each row under its own
run's adapter, each sample the bits its run gives it alone. ``together_problem`` says which
samples of other runs may join a batch (live weights of runs on one shared base with one plain
LoRA adapter on the same layers, in tiles this device computes the same stacked as alone), and
why not in words; the others take their own run's turn.

A sharded session (``session.shards``) is never batched: every rank must make each engine call
rank 0 makes, and what joins a batch is rank 0's timing alone. So each request runs alone, in
the scheduler's order, through the session's announced calls (``reads.sample``:
``session.sample``, then ``prompt_scores`` if asked), which every rank makes (``lockstep``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from trainwire.contract.outcomes import PromptLogprobs, Sample
from trainwire.server.engine.sampling.params import SamplingParams
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.engine.together import row_invariance
from trainwire.server.engine.together.sampling import (
    SessionSample,
    request_problem,
    sample_together,
    sessions_problem,
)
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import reads
from trainwire.server.service.active_run import ActiveRun
from trainwire.server.service.reads import SampleResult, prompt_scoring, sample_weights
from trainwire.server.service.requests import SampleRequest


@dataclass(eq=False)
class PreparedSample:
    """A sample request at its turn: the run it reads and its answer to be."""

    run: ActiveRun
    request: SampleRequest
    params: SamplingParams
    answer: Future[SampleResult] = field(default_factory=Future)

    @classmethod
    def of(cls, run: ActiveRun, request: SampleRequest) -> PreparedSample:
        """``request`` at its turn on ``run``: its weights decided now
        (``reads.resolve_snapshot``), so requests that read the same ones batch."""
        request = reads.resolve_snapshot(run, request)
        return cls(run, request, params_of(request))

    @property
    def weights(self) -> tuple[int, str, str, bool]:
        """What the request reads; a batch of one run's requests reads one of these only."""
        request = self.request
        return id(self.run), request.export_run, request.export, request.base_model

    @property
    def announced(self) -> bool:
        """A sharded session: each request alone, through calls every rank makes."""
        return self.run.session.shards is not None

    @property
    def batches(self) -> bool:
        """Whether others may decode beside it (a sampler told not to: one request a batch)."""
        return self.run.session.sampler.batches


def decode_alone(prepared: PreparedSample) -> None:
    """One request through the session's announced calls (see the module docstring)."""
    try:
        prepared.answer.set_result(reads.sample(prepared.run, prepared.request, None))
    except BaseException as error:  # this request's answer; the next one still runs
        prepared.answer.set_exception(error)
        if not isinstance(error, Exception):
            raise


def decode_batch(batch: list[PreparedSample], join: Callable[[], list[PreparedSample]]) -> None:
    """``batch`` as one decode; ``join()`` gives the requests that join it at each step.

    A batch of one run's requests decodes through its session (``sample_many``), and what
    joins it must read its weights. A batch of several runs' requests (each ``together_problem``
    None beside the first) decodes through ``together.sampling``, and a request of any run
    that ``together_problem`` allows may join it.
    """
    first = batch[0]

    def joined() -> list[PreparedSample]:
        more = join()
        batch.extend(more)
        return more

    try:
        if any(prepared.run is not first.run for prepared in batch):
            sample_together(
                [_of_session(p) for p in batch],
                lambda: [_of_session(p) for p in joined()],
                row_invariance(first.run.session.model),
            )
        else:
            selected = sample_weights(first.run, first.request)
            batched = [_batched(p) for p in batch]
            first.run.session.sample_many(selected, batched, lambda: list(map(_batched, joined())))
    except BaseException as error:  # the batch failed: every request not answered hears why
        for prepared in batch:
            if not prepared.answer.done():
                prepared.answer.set_exception(error)
        if not isinstance(error, Exception):
            raise


def together_problem(first: PreparedSample, other: PreparedSample) -> str | None:
    """None when ``other`` may decode in the batch ``first`` leads (``decode_batch``); else why
    it waits for a turn of its own run's, in words.

    Requests of one run decode together when they read the same weights. Requests of two runs
    do when both read their runs' live weights, the runs' sessions may put each one's adapter
    on its own rows of one forward (``together.sampling.sessions_problem``: one shared base,
    one plain LoRA adapter on the same layers, neither sharded nor decoding alone), and the
    device gives both requests' tiles the same bits stacked as alone (``request_problem``).
    """
    if other.run is first.run:
        if other.weights != first.weights:
            return "it reads other weights than the batch's first request"
        return None
    for which, prepared in (("the batch's first request", first), ("it", other)):
        request = prepared.request
        if request.export or request.base_model:
            return f"{which} reads an export or the base model, not its run's live weights"
    sessions = [first.run.session, other.run.session]
    problem = sessions_problem(sessions)
    if problem is not None:
        return f"the batch's first run is session 0, its run session 1; {problem}"
    invariance = row_invariance(first.run.session.model)
    for prepared in (first, other):
        prompt = prepared.request.prompt_tokens
        problem = request_problem(prepared.run.session, len(prompt), prepared.params, invariance)
        if problem is not None:
            return problem
    return None


def _of_session(prepared: PreparedSample) -> SessionSample:
    return prepared.run.session, _batched(prepared)


def _batched(prepared: PreparedSample) -> BatchedSample:
    request = prepared.request
    answer = prepared.answer

    def on_result(samples: list[Sample], prompt_logprobs: PromptLogprobs | None) -> None:
        answer.set_result(SampleResult(samples, prompt_logprobs))

    return BatchedSample(
        list(request.prompt_tokens),
        prepared.params,
        prompt_scoring(request),
        on_result,
        answer.set_exception,
        request.cancelled,
    )


def params_of(request: SampleRequest) -> SamplingParams:
    """The request's sampling settings, as ``TrainingSession.sample`` builds them (checked
    later, against the session's vocabulary and limits)."""
    settings = request.sampling_settings()
    if isinstance(settings["stop_strings"], str):  # tuple() would split it into characters
        raise InvalidArgument("sample: stop_strings is a list of strings; wrap the one given")
    return SamplingParams(
        settings["max_tokens"],
        settings["num_samples"],
        settings["temperature"],
        settings["top_p"],
        settings["top_k"],
        tuple(settings["stop_tokens"]),
        settings["seed"],
        stop_strings=tuple(settings["stop_strings"]),
        topk_sample_logprobs=request.topk_sample_logprobs,
    )
