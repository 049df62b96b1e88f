"""Other weights in the model for one read-only call, and the live bits back afterwards.

``TrainingSession.sample`` and ``prompt_logprobs`` may read weights other than the live ones
(``SampleWeights``): an export of the run, say a snapshot the trainer has since moved past, or
the base model. The engine owns every change of its weights, so the session swaps them in
itself, inside its operation guard, and no other operation ever sees the swap. The order is what
makes that safe:

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

On a sharded session other weights are planned with ``sharded.weights.agreed_load`` (each rank
reads and checks the whole source with the single-process checks, the ranks agree, each takes
its shards) and swapped into each rank's shards; the live shards come back bit for bit.

The base model under LoRA is the model with its adapter disabled: no copy at all. What the other
sources cost, per call: a copy of the trainable weights in memory (the adapter under LoRA, the
whole model in full) and reading the source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from trainwire.contract.config import TrainingConfig
from trainwire.server.engine.sampling.sample_weights import SampleWeights
from trainwire.server.engine.session.operation_guard import OperationGuard, refuse_out_of_memory
from trainwire.server.engine.sharded.sharding import ShardGroup
from trainwire.server.engine.sharded.weights import agreed_load
from trainwire.server.engine.weights.tensor_files import copy_into
from trainwire.server.engine.weights.transfer import (
    WeightsLoad,
    plan_native_load,
    plan_weights_load,
    read_native_model_tensors,
)
from trainwire.server.errors import FailedPrecondition


def weights_for_reading(
    model: torch.nn.Module,
    selected: SampleWeights,
    *,
    config: TrainingConfig,
    base_fingerprint: str | None,
    base_model_dir: Path,
    guard: OperationGuard,
    shards: ShardGroup | None = None,
    narrow: Callable[[WeightsLoad], WeightsLoad] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """A context in which ``model`` holds ``selected``'s weights.

    The source is read and checked now, when this is called; the weights go in when the context
    is entered and the live bits come back when it exits. Call it inside the session's
    ``guard.operation(changes_state=False)``, and only read the model within. With ``shards``
    (a collective then: every rank calls it, its model resharded first), every rank reads and
    checks the whole source, the ranks agree, and each swaps its own shards. ``narrow`` takes
    the checked load and returns what may really be written (a session on a shared base keeps
    its own tensors only), before any live bit is copied aside.
    """
    if selected.live:
        return contextlib.nullcontext()
    if selected.base_model and config.lora is not None:
        return _adapter_disabled(model, guard)

    def plan() -> WeightsLoad:
        if selected.base_model:
            # The directory the session loaded, read as a native model (whatever else it holds).
            tensors = read_native_model_tensors(base_model_dir)
            load = WeightsLoad(pairs=plan_native_load(model, tensors))
        else:
            assert selected.export is not None
            _refuse_missing(selected.export)
            load = plan_weights_load(model, selected.export, config, base_fingerprint)
        return load if narrow is None else narrow(load)

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
