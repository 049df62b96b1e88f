"""The one table of operations: what each thing a client can ask of the session is, in one place.

Every transport (the gRPC servicer, the Tinker front) decodes its request into one of the typed
requests (``requests``) and calls ``SessionHost.apply(operation, request, spec)``; nothing else
reaches the engine. An ``Operation`` says, for one kind:

- ``request_type``: the typed request a transport builds;
- ``check``: what is refused before anything is queued (names, bounds, the model root);
- ``payload``: what a key is bound to: digested and journaled, so the same key with another
  payload is ALREADY_EXISTS. ``None`` marks an unkeyed operation, which changes no continuation
  state (a read, or removing snapshot exports) and takes no key;
- ``apply``: the engine call, on the engine thread; a keyed one returns its outcome's fields beyond
  key and position, a read returns its result;
- ``outcome_type``: what a keyed operation's journaled result is read back as;
- ``complete``: where the caller's outcome needs more than the journal keeps (an export's
  directory on this side), applied to fresh and replayed outcomes alike;
- ``together``: for a call the engine may run in one pass over a shared base with other runs'
  calls (``engine.together``), its engine request and what its ``apply`` makes of the engine's
  result, as two functions (``SharedPass``): its ``apply`` is the two composed around the
  session's own call, so alone and together give the same fields.

The keyed operations' checks, payloads and engine calls are below; the unkeyed ones' are in
``reads``. A new operation is one entry here (and its request type in ``requests``); a new field
of a request is one field of its request type, read in its ``payload`` and ``apply``, and decoded
by each transport's codec.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from trainwire.contract import outcomes
from trainwire.contract.outcomes import OperationOutcome
from trainwire.contract.run.selection import BEST_CHECKPOINT
from trainwire.contract.tokens import DEFAULT_LOSS, TokenExample
from trainwire.server.engine.optimization import UpdateSettings
from trainwire.server.engine.session.results import TokenOutput
from trainwire.server.engine.together import Request as EngineRequest
from trainwire.server.engine.together import Result as EngineResult
from trainwire.server.errors import FailedPrecondition, InUse, InvalidArgument, NotFound
from trainwire.server.paths import resolve_under
from trainwire.server.service import reads
from trainwire.server.service.active_run import ActiveRun, Applying
from trainwire.server.service.request_limits import check_batch
from trainwire.server.service.requests import (
    EXPORT_WEIGHTS_KIND,
    SAVE_STATE_KIND,
    CheckpointRequest,
    DetokenizeRequest,
    DiscardExportsRequest,
    ExportWeightsRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SampleRequest,
    TokenizeRequest,
)
from trainwire.server.service.run_checkpoints import (
    checkpoint_extra,
    prune_checkpoints,
    written_by,
)
from trainwire.server.service.state_dir import check_name, list_export_files, sibling_run

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")
Fields = dict[str, Any]  # a keyed outcome's fields beyond its key and position
# Checkpoints retention never removes: the controller keeps its best weights under this name.
KEPT_CHECKPOINT_NAMES = (BEST_CHECKPOINT,)


@dataclass(frozen=True)
class SharedPass(Generic[RequestT]):
    """What a call that may share a pass over its base with other runs' calls asks of the
    engine (``request``), whether the pass runs backward, and what the call's ``apply`` returns
    for the engine's result (``fields``)."""

    backward: bool
    request: Callable[[ActiveRun, RequestT], EngineRequest]
    fields: Callable[[ActiveRun, EngineResult], Any]

    def alone(self, run: ActiveRun, request: RequestT) -> Any:
        """The call run by its session alone: what ``apply`` returns."""
        engine = self.request(run, request)
        call = run.session.forward_backward if self.backward else run.session.forward
        result = call(engine.examples, loss_fn=engine.loss_fn, loss_fn_config=engine.loss_fn_config)
        return self.fields(run, result)


@dataclass(frozen=True)
class Operation(Generic[RequestT]):
    """One kind of operation; see the module docstring for what each field means."""

    kind: str  # as its RPC spells it; a journal entry's ``kind``
    request_type: type[RequestT]
    check: Callable[[RequestT, Path | None], None]  # (request, the model root)
    apply: Callable[[ActiveRun, RequestT, Applying | None], Any]
    payload: Callable[[RequestT], dict[str, Any]] | None = None
    outcome_type: type[OperationOutcome] = OperationOutcome
    complete: Callable[[ActiveRun, RequestT, Any], Any] | None = None
    together: SharedPass[RequestT] | None = None

    @property
    def keyed(self) -> bool:
        """Whether it changes the session: it then takes an operation key and a position."""
        return self.payload is not None


# -- checks: before anything is queued ---------------------------------------------------------


def _check_batch(request: ForwardRequest, _root: Path | None) -> None:
    check_batch(request.examples)


def _given_settings(request: OptimStepRequest) -> dict[str, float | None]:
    """The step's settings by name (None: the run's own), read field by field: this runs on the
    engine thread and the gRPC handlers for every step, where ``dataclasses.asdict`` deep-copies."""
    settings = _update_settings(request)
    return {field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)}


def _update_settings(request: OptimStepRequest) -> UpdateSettings:
    return UpdateSettings(
        request.learning_rate,
        request.beta1,
        request.beta2,
        request.eps,
        request.weight_decay,
        request.max_grad_norm,
    )


def _check_optim_step(request: OptimStepRequest, _root: Path | None) -> None:
    _update_settings(request).check()


def _check_checkpoint(request: CheckpointRequest, _root: Path | None) -> None:
    check_name(request.name, "checkpoint")
    if request.run_id:
        check_name(request.run_id, "run id")


def _check_weights_source(request: LoadWeightsRequest, model_root: Path | None) -> None:
    """A checkpoint or export name, or a model path that resolves under the model root."""
    source = request.source
    if request.run_id:
        check_name(request.run_id, "run id")
        if source.kind not in ("checkpoint", "export"):
            raise InvalidArgument("another run's weights are one of its checkpoints or exports")
    if source.kind in ("checkpoint", "export"):
        check_name(source.value, source.kind)
    elif source.kind == "model_path":
        resolve_under(model_root, source.value, "model path")
    else:
        raise InvalidArgument(
            f"weights source {source.kind!r}: use {outcomes.WEIGHTS_SOURCE_KINDS}"
        )


def _check_export(request: ExportWeightsRequest, _root: Path | None) -> None:
    check_name(request.name, "export")
    if request.checkpoint:
        check_name(request.checkpoint, "checkpoint")


# -- payloads: what a key is bound to ------------------------------------------------------------


def _forward_backward_payload(request: ForwardBackwardRequest) -> dict[str, Any]:
    """Text batches digest their examples alone (a digest that changed would refuse a re-sent key
    that a journal recorded as another payload); token batches add the loss and its settings, so
    another loss under the same key is refused."""
    named = {"loss_fn": request.loss_fn, "loss_fn_config": dict(request.loss_fn_config)}
    examples = request.examples
    if examples and isinstance(examples[0], TokenExample):
        return {"token_examples": [example.to_dict() for example in examples], **named}
    payload: dict[str, Any] = {"examples": [example.to_dict() for example in examples]}
    if named != {"loss_fn": DEFAULT_LOSS, "loss_fn_config": {}}:
        payload.update(named)  # refused by the engine; never replayed as the plain batch
    return payload


def _optim_step_payload(request: OptimStepRequest) -> dict[str, Any]:
    """Every setting given; a step with the defaults digests as ``{}``, the digest every journal
    holds for a plain step."""
    payload: dict[str, Any] = {
        name: value for name, value in _given_settings(request).items() if value is not None
    }
    if request.sum_microbatches:
        payload["sum_microbatches"] = True
    return payload


def _checkpoint_payload(request: CheckpointRequest) -> dict[str, Any]:
    """The name; another run's adds its id (this run's name alone, the digest journals hold)."""
    return {"name": request.name, **({"run_id": request.run_id} if request.run_id else {})}


def _load_weights_payload(request: LoadWeightsRequest) -> dict[str, Any]:
    source = {"kind": request.source.kind, "value": request.source.value}
    return {**source, **({"run_id": request.run_id} if request.run_id else {})}


def _export_payload(request: ExportWeightsRequest) -> dict[str, Any]:
    return {"name": request.name, "checkpoint": request.checkpoint}


# -- applies: the engine calls, on the engine thread ----------------------------------------------


def engine_request(run: ActiveRun, request: ForwardRequest) -> EngineRequest:
    """A ``forward_backward`` or ``forward`` as the engine runs it, alone or together."""
    return EngineRequest(run.session, request.examples, request.loss_fn, request.loss_fn_config)


def _forward_backward_fields(run: ActiveRun, result: EngineResult) -> Fields:
    """A forward_backward outcome's fields, from the engine's result (alone or together)."""
    fields: Fields = {"token_count": run.session.last_token_count}
    if isinstance(result, TokenOutput):
        logprobs, metrics = reads.token_fields(result)
        return {**fields, "loss": result.loss, "logprobs": logprobs, "metrics": metrics}
    return {**fields, "loss": result}


FORWARD_BACKWARD_PASS = SharedPass(True, engine_request, _forward_backward_fields)
FORWARD_PASS = SharedPass(False, engine_request, reads.forward_outcome)


def _forward_backward(
    run: ActiveRun, request: ForwardBackwardRequest, _: Applying | None
) -> Fields:
    return FORWARD_BACKWARD_PASS.alone(run, request)


def _forward(run: ActiveRun, request: ForwardRequest, _: Applying | None) -> Any:
    return FORWARD_PASS.alone(run, request)


def _optim_step(run: ActiveRun, request: OptimStepRequest, _: Applying | None) -> Fields:
    settings = _given_settings(request)
    result = run.session.optim_step(**settings, sum_microbatches=request.sum_microbatches)
    rate, grad_norm = result.learning_rate, result.grad_norm
    return {"step": result.step, "learning_rate": rate, "grad_norm": grad_norm}


def _save_state(run: ActiveRun, request: CheckpointRequest, applying: Applying | None) -> Fields:
    """The checkpoint carries its own journal entry: recovery restores it and re-commits it."""
    assert applying is not None
    path = run.run.checkpoint(request.name)
    _refuse_writing_over_a_read(run, request.name, path)
    run.wait_for_journal()  # the checkpoint holds no operation the journal might still lose
    session, name = run.session, request.name
    fields = {"state_digest": session.state_digest(), "name": name, "step": session.step}
    entry = applying.entry(applying.outcome(fields))
    try:
        session.save_state(path, extra=checkpoint_extra(run.spec.run_id, entry))
    except Exception:
        if not written_by(path, entry):
            raise  # nothing became visible: the save did not happen
        # The checkpoint is in place (a step after its rename failed, e.g. the directory's
        # fsync): recovery would restore it at this position, so the save counts as applied.
        logger.exception("save_state %r failed after its checkpoint was in place", name)
    if run.keep_checkpoints:
        protected = {name, *KEPT_CHECKPOINT_NAMES}
        prune_checkpoints(
            run.run,
            run.spec.run_id,
            run.keep_checkpoints,
            protected,
            read_elsewhere=lambda folder: bool(run.checkpoint_readers(folder)),
        )
    return fields


def _refuse_writing_over_a_read(run: ActiveRun, name: str, path: Path) -> None:
    """A save over a checkpoint that another run read, with a replay of that read still to
    come after a restart, would make the replay read other files than the run was answered
    from: a removal of what was read, refused as a delete is (InUse, 409)."""
    readers = run.checkpoint_readers(name) if path.is_dir() else []
    if readers:
        raise InUse(
            f"checkpoint {name!r} cannot be saved over yet: {readers[0]} of an open run read "
            "it, and a restart replays that call from these files; save under another name, "
            "or again once that run has saved a checkpoint (save_state) or closed"
        )


def _load_state(run: ActiveRun, request: CheckpointRequest, _: Applying | None) -> Fields:
    saved_by = sibling_run(run.run, request.run_id) if request.run_id else run.run
    run.session.load_state(saved_by.checkpoint(request.name))
    run.restored_checkpoint = request.name
    return {"name": request.name, "step": run.session.step}


def _load_weights(run: ActiveRun, request: LoadWeightsRequest, _: Applying | None) -> Fields:
    """From this run's checkpoint or export, or a model path under the model root (resolved
    again here: the check refused a bad one before queueing, this reads where it points now)."""
    source = request.source
    saved_by = sibling_run(run.run, request.run_id) if request.run_id else run.run
    if source.kind == "checkpoint":
        path = saved_by.checkpoint(source.value)
    elif source.kind == "export":
        path = saved_by.export(source.value)
    else:
        path = resolve_under(run.model_root, source.value, "model path")
    run.session.load_weights(path)
    return {}


def _export_weights(run: ActiveRun, request: ExportWeightsRequest, _: Applying | None) -> Fields:
    target = run.run.export(request.name)
    if request.written_once and target.exists() and _written_by_the_run(run, request.name):
        raise FailedPrecondition(f"{request.written_once} exist already; save under a new name")
    if request.checkpoint:
        source = run.run.checkpoint(request.checkpoint)
        if not source.is_dir():
            raise NotFound(f"no checkpoint named {request.checkpoint!r}; save_state it first")
        run.session.export_checkpoint_weights(source, target)
    else:
        run.session.export_weights(target)
    adapter = run.spec.config.get("lora") is not None
    return {
        "name": request.name,
        "format": outcomes.FORMAT_ADAPTER if adapter else outcomes.FORMAT_FULL,
        "files": list_export_files(target),
    }


def _written_by_the_run(run: ActiveRun, export: str) -> bool:
    """Whether a live journal entry wrote ``export``: a folder a crash left before its writer's
    entry committed is no one's (no client was answered it), and its replay writes it again."""
    return run.journal.returned_name(EXPORT_WEIGHTS.kind, export)


def _export_directory(
    run: ActiveRun, request: ExportWeightsRequest, outcome: outcomes.ExportOutcome
) -> outcomes.ExportOutcome:
    """The export's directory on this side, which the gRPC transport streams files from."""
    return dataclasses.replace(outcome, directory=run.run.export(request.name))


# -- the table ---------------------------------------------------------------------------------

FORWARD = Operation("Forward", ForwardRequest, _check_batch, _forward, together=FORWARD_PASS)
FORWARD_BACKWARD = Operation(
    "ForwardBackward",
    ForwardBackwardRequest,
    _check_batch,
    _forward_backward,
    _forward_backward_payload,
    outcomes.ForwardBackwardOutcome,
    together=FORWARD_BACKWARD_PASS,
)
OPTIM_STEP = Operation(
    "OptimStep",
    OptimStepRequest,
    _check_optim_step,
    _optim_step,
    _optim_step_payload,
    outcomes.OptimStepOutcome,
)
SAVE_STATE = Operation(
    SAVE_STATE_KIND,
    CheckpointRequest,
    _check_checkpoint,
    _save_state,
    _checkpoint_payload,
    outcomes.CheckpointOutcome,
)
LOAD_STATE = Operation(
    "LoadState",
    CheckpointRequest,
    _check_checkpoint,
    _load_state,
    _checkpoint_payload,
    outcomes.CheckpointOutcome,
)
LOAD_WEIGHTS = Operation(
    "LoadWeights", LoadWeightsRequest, _check_weights_source, _load_weights, _load_weights_payload
)
EXPORT_WEIGHTS = Operation(
    EXPORT_WEIGHTS_KIND,
    ExportWeightsRequest,
    _check_export,
    _export_weights,
    _export_payload,
    outcomes.ExportOutcome,
    complete=_export_directory,
)
SAMPLE = Operation("Sample", SampleRequest, reads.check_sample, reads.sample)
DISCARD_EXPORTS = Operation(
    "DiscardExports", DiscardExportsRequest, reads.check_discard, reads.discard_exports
)
TOKENIZE = Operation("Tokenize", TokenizeRequest, reads.check_tokenize, reads.tokenize)
DETOKENIZE = Operation("Detokenize", DetokenizeRequest, reads.check_detokenize, reads.detokenize)

OPERATIONS: dict[str, Operation[Any]] = {
    operation.kind: operation
    for operation in (
        FORWARD,
        FORWARD_BACKWARD,
        OPTIM_STEP,
        SAVE_STATE,
        LOAD_STATE,
        LOAD_WEIGHTS,
        EXPORT_WEIGHTS,
        SAMPLE,
        DISCARD_EXPORTS,
        TOKENIZE,
        DETOKENIZE,
    )
}
"""Every operation by kind; a keyed one's kind is what its journal entries record."""
