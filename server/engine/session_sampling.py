"""A session's samples and prompt logprobs, from the weights the caller selects.

``TrainingSession.sample`` and ``prompt_logprobs`` delegate here. Both are read-only operations
under the session's guard (its lock, its RNG put back afterwards, refused while it is broken),
and both may read weights other than the live ones (``SampleWeights``): an export of the run, say
a snapshot the trainer has since moved past, or the base model. The engine owns every change of
its weights, so it swaps them in itself, inside that guard, and no other operation ever sees the
swap. The order is what makes that safe:

1. The request is checked, then the weights' source is read completely and checked
   (``plan_weights_load``: names, shapes, dtypes, adapter settings, base model), all before a
   live tensor changes, so a refused request or source (missing, another model's, damaged)
   changes nothing.
2. The live bits of every parameter the load may write are copied aside before the load: running
   out of memory there changes nothing either.
3. The load goes in, the sampler reads the model, and the live bits go back in a ``finally``,
   whatever happened in between. Only a failure of that restore leaves the model holding other
   weights than the session's state says it has, so only it marks the session broken (it refuses
   everything until a ``load_state``).

A sharded session (``session.shards``) samples the same way on every rank, each rank calling
with the same arguments (``lockstep`` announces the call): the decode runs on the FSDP model,
each forward gathering the weights, with rank 0's draws (``batch_decode``) and rank 0's decoding
mode, so every rank runs the same forwards; every rank returns rank 0's answer. Other weights
are planned with ``sharded_weights.agreed_load`` (each rank reads and checks the whole source
with the single-process checks, the ranks agree, each takes its shards) and swapped into each
rank's shards; the live shards come back bit for bit. Every FSDP module is resharded before
the swap and after the decode, so what is swapped, put back, stepped and hashed are the shards.

The session's state version does not move: the bits afterwards are the bits before, so the cached
state digest stays true. The base model under LoRA is the model with its adapter disabled: no
copy at all. What the other sources cost, per call: a copy of the trainable weights in memory (the
adapter under LoRA, the whole model in full) and reading the source.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainwire.contract.config import TrainingConfig
from trainwire.contract.outcomes import Sample
from trainwire.server.engine.batch_decode import Cancel
from trainwire.server.engine.operation_guard import OperationGuard, refuse_out_of_memory
from trainwire.server.engine.sample_weights import SampleWeights
from trainwire.server.engine.sampling import SampleCall, SamplingParams
from trainwire.server.engine.sharded_weights import agreed_load
from trainwire.server.engine.sharding import ShardGroup, reshard
from trainwire.server.engine.tensor_files import copy_into
from trainwire.server.engine.weights import (
    WeightsLoad,
    plan_native_load,
    plan_weights_load,
    read_native_model_tensors,
)
from trainwire.server.errors import Cancelled, FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from trainwire.server.engine.session import TrainingSession


def sample(
    session: TrainingSession, prompt: list[int], params: SamplingParams, selected: SampleWeights
) -> list[Sample]:
    sampler = session.sampler
    # Checked before any weights are read (the sampler checks it again: a cheap repeat).
    check = functools.partial(params.check, prompt, sampler.vocab_size, sampler.limits)
    with _reading(session, selected, check):
        shards = session.shards
        if shards is None:
            return sampler.sample(session.model, prompt, params)
        # The tiles' shape decides the forwards: rank 0's mode (the host sets it there only).
        sampler.batches, sampler.tile_rows = shards.broadcast((sampler.batches, sampler.tile_rows))
        return shards.broadcast(sampler.sample(session.model, prompt, params))


@dataclass(frozen=True)
class BatchedSample:
    """One request of ``sample_many``: what ``sample`` takes, whether the prompt is scored too
    (``prompt_logprobs``), and where its answer goes: ``on_result(samples, prompt_logprobs or
    None)`` once it is done, or ``on_error`` with why it was refused or failed."""

    prompt: list[int]
    params: SamplingParams
    with_prompt_logprobs: bool
    on_result: Callable[[list[Sample], list[float] | None], None]
    on_error: Callable[[Exception], None]
    cancelled: Callable[[], bool] | None = None  # whether the caller gave up (polled per step)


def sample_many(
    session: TrainingSession,
    selected: SampleWeights,
    requests: Sequence[BatchedSample],
    join: Callable[[], list[BatchedSample]] = list,
) -> None:
    """``requests`` (and those ``join`` hands over between decode steps), all under
    ``selected``'s weights, decoded as one batch: each gets what ``sample`` gives it alone.

    Each request is checked on its own first, and refused on its own; a failure of the batch
    itself (its weights' source missing, out of memory) reaches every request not yet answered.
    A sharded session refuses: what joins a batch is rank 0's timing alone, which the other
    ranks cannot follow; it samples through ``sample`` (announced to every rank), one request
    at a time (``service.sample_batching``).
    """
    if session.shards is not None:
        raise FailedPrecondition(
            "sample_many: a sharded session samples one request at a time through "
            "TrainingSession.sample and prompt_logprobs, which every rank calls"
        )
    sampler = session.sampler
    model = session.model

    def accepted(batch: Sequence[BatchedSample]) -> list[SampleCall]:
        calls = []
        for request in batch:
            try:
                request.params.check(request.prompt, sampler.vocab_size, sampler.limits)
            except InvalidArgument as error:
                request.on_error(error)
                continue
            prompt, answer = tuple(request.prompt), _answer(request)
            calls.append(SampleCall(prompt, request.params, answer, _cancel(request)))
        return calls

    def _cancel(request: BatchedSample) -> Cancel | None:
        if request.cancelled is None:
            return None
        gave_up = Cancelled("sample: the caller gave up; decoding stopped")
        return Cancel(request.cancelled, lambda: request.on_error(gave_up))

    def _answer(request: BatchedSample) -> Callable[[list[Sample]], None]:
        def answer(samples: list[Sample]) -> None:
            scored = None
            if request.with_prompt_logprobs:
                scored = sampler.prompt_logprobs(model, request.prompt)
            request.on_result(samples, scored)

        return answer

    if session.config.task != "causal-lm":
        error = InvalidArgument(f"sampling needs a causal-lm session, not {session.config.task}")
        for request in requests:
            request.on_error(error)
        return
    calls = accepted(requests)
    if not calls:
        return
    with _reading(session, selected, lambda: None):
        sampler.sample_many(model, calls, lambda: accepted(join()))


def prompt_logprobs(
    session: TrainingSession, prompt: list[int], selected: SampleWeights
) -> list[float]:
    with _reading(session, selected, lambda: session.sampler.check_prompt(prompt)):
        scored = session.sampler.prompt_logprobs(session.model, prompt)
        return scored if session.shards is None else session.shards.broadcast(scored)


@contextlib.contextmanager
def _reading(
    session: TrainingSession, selected: SampleWeights, check: Callable[[], None]
) -> Iterator[None]:
    """The session's read-only operation with ``selected``'s weights in the model (the
    module's order: the request checked, the source checked, the swap, the live bits back)."""
    guard = session._guard
    with guard.operation(changes_state=False):
        if session.config.task != "causal-lm":
            raise InvalidArgument(f"sampling needs a causal-lm session, not {session.config.task}")
        check()
        if session.shards is not None:
            reshard(session.model)  # what a swap plans against and writes: the shards
        swap = weights_for_reading(
            session.model,
            selected,
            config=session.config,
            base_fingerprint=session.base_fingerprint,
            base_model_dir=session.model_dir,
            guard=guard,
            shards=session.shards,
        )
        session._set_training(False)
        resharded = _resharded_after(session.model, session.shards)
        # Innermost, so an out-of-memory error is reported only after the live bits are back;
        # resharded inside the swap, so the live bits go back into the shards.
        with swap, resharded, torch.no_grad(), refuse_out_of_memory("sample"):
            yield


@contextlib.contextmanager
def _resharded_after(model: torch.nn.Module, shards: ShardGroup | None) -> Iterator[None]:
    """Every FSDP module back to its shards after the block (``sharding.reshard``: a forward
    alone leaves the root's weights gathered); nothing without a group."""
    try:
        yield
    finally:
        if shards is not None:
            reshard(model)


def weights_for_reading(
    model: torch.nn.Module,
    selected: SampleWeights,
    *,
    config: TrainingConfig,
    base_fingerprint: str | None,
    base_model_dir: Path,
    guard: OperationGuard,
    shards: ShardGroup | None = None,
) -> contextlib.AbstractContextManager[None]:
    """A context in which ``model`` holds ``selected``'s weights.

    The source is read and checked now, when this is called; the weights go in when the context
    is entered and the live bits come back when it exits. Call it inside the session's
    ``guard.operation(changes_state=False)``, and only read the model within. With ``shards``
    (a collective then: every rank calls it, its model resharded first), every rank reads and
    checks the whole source, the ranks agree, and each swaps its own shards.
    """
    if selected.live:
        return contextlib.nullcontext()
    if selected.base_model and config.lora is not None:
        return _adapter_disabled(model, guard)

    def plan() -> WeightsLoad:
        if selected.base_model:
            # The directory the session loaded, read as a native model (whatever else it holds).
            tensors = read_native_model_tensors(base_model_dir)
            return WeightsLoad(pairs=plan_native_load(model, tensors))
        assert selected.export is not None
        _refuse_missing(selected.export)
        return plan_weights_load(model, selected.export, config, base_fingerprint)

    if shards is None:
        return _swapped_in(model, plan(), guard)
    _, in_shards = agreed_load(shards, model, plan)
    return _swapped_in(model, in_shards, guard)


def _refuse_missing(export: Path) -> None:
    if not export.is_dir():
        # Named by its directory, never by the server's path: clients read this message.
        raise FailedPrecondition(
            f"no weights to sample at {export.name!r}: that export of this run was "
            "removed (an old snapshot pruned, say) or never written; nothing changed. Export the "
            "weights again and sample that, or sample the live weights"
        )


@contextlib.contextmanager
def _swapped_in(model: torch.nn.Module, load: WeightsLoad, guard: OperationGuard) -> Iterator[None]:
    """``load`` in the model for the block; every live bit it may have written back afterwards."""
    # What the load may write: its pairs' live tensors, or for an adapter (no pairs) the adapter's
    # own parameters, which are the ones that train (modules_to_save included).
    targets = {id(p): p for p in model.parameters() if p.requires_grad}
    targets.update({id(live): live for live, _ in load.pairs})
    with refuse_out_of_memory("sample"):  # nothing has changed yet
        saved = [(parameter, parameter.detach().clone()) for parameter in targets.values()]
    try:
        # Out of memory midway through the load still changes nothing in the end: the finally
        # below puts every live bit back before the error reaches the caller.
        with refuse_out_of_memory("sample"):
            load.apply(model)
        yield
    finally:
        with guard.breaks_on_failure("sample (putting the live weights back)"):
            copy_into(saved)


@contextlib.contextmanager
def _adapter_disabled(model: torch.nn.Module, guard: OperationGuard) -> Iterator[None]:
    """The LoRA model without its adapter for the block (PEFT's ``disable_adapter``)."""
    disabled = model.disable_adapter()
    disabled.__enter__()
    try:
        yield
    finally:
        # Enabling the adapter again is what gives the live weights back: a failure there is a
        # failure to restore them. A failure in the block, by contrast, must not break anything.
        with guard.breaks_on_failure("sample (enabling the adapter again)"):
            disabled.__exit__(None, None, None)
