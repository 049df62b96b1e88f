"""Sample requests that wait together decode together, in order with everything else.

Every sample request (gRPC ``Sample``, the Tinker front's ``asample``) is registered here and
queues one *batch call* on the executor, as any read does. The first batch call to run takes
every registered request it may and decodes them as one batch (``TrainingSession.sample_many``);
the later calls find theirs answered and return. While a batch decodes, a request that arrives
joins it at the next step. Which request a batch may take is what keeps the order the service
promises: a request is taken only by a batch call queued after every call that was queued before
the request arrived (the executor's ``epoch`` says which), and once any other call is queued, no
request joins the running batch any more. So a read never sees weights older than a call queued
before it, training calls keep their order and run exactly once, and a training call
queued while a batch decodes waits for the rows that were already there (queued before it, they
ran first anyway) plus at most the one decode step under way.

Requests of one batch read the same weights (the live ones, one export, or the base model):
requests for other weights wait for the next batch. What a request draws does not depend on its
company (``batch_decode``), and what it asks about its samples and prompt beyond the draws (top-k
and target logprobs) is scored for it alone after its draws, so batching changes no result and
requests asking for different logprobs decode together.

A sharded session (``session.shards``) is never batched here: every rank must make each engine
call rank 0 makes, and what joins a batch is rank 0's timing alone. So each request runs alone,
in the executor's order, through the session's announced calls (``reads.sample``:
``session.sample``, then ``prompt_scores`` if asked), which every rank makes (``lockstep``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from trainwire.contract.outcomes import PromptLogprobs, Sample
from trainwire.server.engine.sampling.params import SamplingParams
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import reads
from trainwire.server.service.active_run import ActiveRun
from trainwire.server.service.executor import SessionExecutor
from trainwire.server.service.reads import SampleResult, prompt_scoring, sample_weights
from trainwire.server.service.requests import SampleRequest

SETTLE_S = 0.02  # the longest a batch waits for requests still arriving
SETTLE_STEP_S = 0.002  # requests arriving further apart than this start apart


@dataclass(eq=False)
class _Waiting:
    """A registered request: the executor's epoch when it arrived, and its answer to be."""

    request: SampleRequest
    params: SamplingParams
    epoch: int
    answer: Future[SampleResult] = field(default_factory=Future)

    @property
    def weights(self) -> tuple[str, str, bool]:
        """What the request reads; a batch holds requests of one weights only."""
        return self.request.export_run, self.request.export, self.request.base_model


class SampleBatcher:
    """Collects sample requests and decodes those that may run together as one batch.

    Args:
        executor: the session's executor (its ``epoch`` orders requests against other calls).
        active: the open run, called on the executor thread (raises while none is open).
    """

    def __init__(self, executor: SessionExecutor, active: Callable[[], ActiveRun]) -> None:
        self._executor = executor
        self._active = active
        self._lock = threading.Lock()
        self._pending: list[_Waiting] = []

    def submit(
        self, request: SampleRequest, queue: Callable[[Callable[[], None]], Any]
    ) -> SampleResult:
        """The request's samples; ``queue(call)`` runs ``call`` on the executor as a read
        (joinable: it moves no epoch), with the read's admission and refusals."""
        waiting = _Waiting(request, params_of(request), self._executor.epoch)
        with self._lock:
            self._pending.append(waiting)
        try:
            queue(lambda: self._run_batches(waiting.epoch))
        except BaseException:
            with self._lock:
                refused = waiting in self._pending  # no batch took it: it never ran
                if refused:
                    self._pending.remove(waiting)
            if refused:
                raise
        return waiting.answer.result()

    def _run_batches(self, epoch: int) -> None:
        """On the executor thread: batch after batch of what this call may take."""
        run = self._active()  # no run open: refused, and the requests stay for their own calls
        if run.session.shards is not None:
            self._run_announced(run, epoch)
            return
        together = run.session.sampler.batches  # else one request a batch, none joining
        while True:
            if together:
                self._settle()
            batch = self._take(epoch, alone=not together)
            if not batch:
                return
            self._decode(run, batch, epoch if together else None)

    def _run_announced(self, run: ActiveRun, epoch: int) -> None:
        """A sharded session: each request this call may take, alone and in order, through the
        session's calls that every rank makes (see the module docstring)."""
        while batch := self._take(epoch, alone=True):
            (waiting,) = batch
            try:
                waiting.answer.set_result(reads.sample(run, waiting.request, None))
            except BaseException as error:  # this request's answer; the next one still runs
                waiting.answer.set_exception(error)
                if not isinstance(error, Exception):
                    raise

    def _settle(self) -> None:
        """Wait while requests keep arriving, a few milliseconds at most: requests sent at one
        moment (a loop's futures) then start as one batch, where one arriving a step late would
        decode at another length, in tiles of its own (``batch_decode``)."""
        deadline = time.monotonic() + SETTLE_S
        seen = -1
        while time.monotonic() < deadline:
            with self._lock:
                arrived = len(self._pending)
            if arrived == seen:
                break
            seen = arrived
            time.sleep(SETTLE_STEP_S)

    def _take(
        self, epoch: int, weights: tuple[str, str, bool] | None = None, *, alone: bool = False
    ) -> list[_Waiting]:
        """The registered requests a batch call of ``epoch`` may take, of ``weights`` (or of
        the first such request's; only that one when ``alone``), removed from the waiting list."""
        with self._lock:
            eligible = [w for w in self._pending if w.epoch <= epoch]
            if not eligible:
                return []
            weights = eligible[0].weights if weights is None else weights
            taken = [w for w in eligible if w.weights == weights][: 1 if alone else None]
            self._pending = [w for w in self._pending if w not in taken]
        return taken

    def _decode(self, run: ActiveRun, batch: list[_Waiting], epoch: int | None) -> None:
        """``batch`` as one decode; requests of its weights join it while nothing else waits
        (none when ``epoch`` is None)."""
        weights = batch[0].weights

        def join() -> list[BatchedSample]:
            if epoch is None or self._executor.epoch != epoch:  # another call waits: no joins
                return []
            joined = self._take(epoch, weights)
            batch.extend(joined)
            return [_batched(w) for w in joined]

        try:
            selected = sample_weights(run, batch[0].request)
            run.session.sample_many(selected, [_batched(w) for w in batch], join)
        except BaseException as error:  # the batch failed: every request not answered hears why
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(error)
            if not isinstance(error, Exception):
                raise


def _batched(waiting: _Waiting) -> BatchedSample:
    request = waiting.request
    answer = waiting.answer

    def on_result(samples: list[Sample], prompt_logprobs: PromptLogprobs | None) -> None:
        answer.set_result(SampleResult(samples, prompt_logprobs))

    return BatchedSample(
        list(request.prompt_tokens),
        waiting.params,
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
