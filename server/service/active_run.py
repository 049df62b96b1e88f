"""The active run: its folder, spec, engine and journal, and the one path every keyed operation
takes through them.

The session host decides *whether* a run may take operations (lifecycle) and runs them on its
executor; ``ActiveRun.apply_keyed`` decides what a keyed operation does, in this order:

1. the journal: the key seen with the same payload digest → the journaled result, nothing runs;
   the same key with another payload → ALREADY_EXISTS;
2. ``expected_position`` differs from the position → FAILED_PRECONDITION (``PositionMismatch``);
3. the engine runs it (an engine error changes nothing and is not journaled);
4. the journal commits it durably with its position; only then does the caller hear of it.

The operations themselves (``forward_backward``, ``save_state``, ...) only call the engine and
return the outcome's fields; ``Applying`` tells the one that needs it (SaveState, which embeds its
own journal entry in the checkpoint) where it will land.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.client import outcomes
from trainwire.client.config import InputExample
from trainwire.client.outcomes import OperationOutcome, OperationSpec
from trainwire.client.tokens import DEFAULT_LOSS, TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session_results import TokenOutput
from trainwire.server.errors import AlreadyExists, InvalidArgument, NotFound, PositionMismatch
from trainwire.server.paths import resolve_under
from trainwire.server.service.journal import (
    EXPORT_WEIGHTS,
    OUTCOME_TYPES,
    Journal,
    JournalEntry,
    outcome_from_record,
    outcome_record,
)
from trainwire.server.service.recovery import (
    checkpoint_extra,
    latest_checkpoint,
    prune_checkpoints,
    restore_into,
    written_by,
)
from trainwire.server.service.state_dir import RunDirectory, RunSpec, check_name, list_export_files

logger = logging.getLogger(__name__)

Fields = dict[str, Any]  # an outcome's fields beyond its key and position
# Checkpoints retention never removes: the controller keeps its best weights under this name.
KEPT_CHECKPOINT_NAMES = ("best",)
Examples = Sequence[InputExample] | Sequence[TokenExample]
LossChoice = tuple[str, Mapping[str, float]]  # (loss_fn, loss_fn_config)


def forward_backward_payload(examples: Examples, loss: LossChoice) -> dict[str, Any]:
    """What a ForwardBackward key is bound to. Text batches digest as they always have; token
    batches add the loss and its settings, so another loss under the same key is refused."""
    named = {"loss_fn": loss[0], "loss_fn_config": dict(loss[1])}
    if examples and isinstance(examples[0], TokenExample):
        return {"token_examples": [example.to_dict() for example in examples], **named}
    payload: dict[str, Any] = {"examples": [example.to_dict() for example in examples]}
    if named != {"loss_fn": DEFAULT_LOSS, "loss_fn_config": {}}:
        payload.update(named)  # refused by the engine; never replayed as the plain batch
    return payload


def optim_step_payload(learning_rate: float | None, sum_microbatches: bool) -> dict[str, Any]:
    """What an OptimStep key is bound to (a step with the defaults digests as it always has)."""
    payload: dict[str, Any] = {} if learning_rate is None else {"learning_rate": learning_rate}
    if sum_microbatches:
        payload["sum_microbatches"] = True
    return payload


def check_weights_source(source: outcomes.WeightsSource, model_root: Path | None) -> Path | None:
    """Refuse a bad source before queueing; a model path comes back resolved under the root."""
    if source.kind in ("checkpoint", "export"):
        check_name(source.value, source.kind)
        return None
    if source.kind == "model_path":
        return resolve_under(model_root, source.value, "model path")
    raise InvalidArgument(f"weights source {source.kind!r}: use {outcomes.WEIGHTS_SOURCE_KINDS}")


def _token_fields(result: TokenOutput) -> tuple[tuple[tuple[float, ...], ...], dict[str, float]]:
    return tuple(tuple(row) for row in result.logprobs), dict(result.metrics)


class JournalCommitFailed(RuntimeError):
    """The engine applied an operation but the journal could not commit it."""


def wait_durable(durable: Durable, key: str) -> None:
    """Block until the commit behind an outcome is on disk; ``JournalCommitFailed`` if not."""
    if durable is None:
        return
    try:
        durable.result()
    except Exception as error:
        raise JournalCommitFailed(f"the journal could not record {key!r}: {error}") from error


@dataclass(frozen=True)
class Applying:
    """The keyed operation being applied: its kind, key, the position it will have and the
    digest of its payload."""

    kind: str
    key: str
    position: int
    payload_digest: str

    def outcome(self, fields: Fields) -> OperationOutcome:
        return OUTCOME_TYPES[self.kind](self.key, self.position, **fields)

    def entry(self, outcome: OperationOutcome) -> JournalEntry:
        """The journal entry that commits ``outcome``."""
        return JournalEntry(
            self.key, self.kind, self.payload_digest, self.position, outcome_record(outcome)
        )


EngineCall = Callable[[Applying], Fields]
Durable = futures.Future[None] | None  # an outcome's pending commit


class ActiveRun:
    """The run a server has open; ``position`` counts the state-changing operations applied."""

    def __init__(
        self, run: RunDirectory, spec: RunSpec, session: TrainingSession, journal: Journal
    ) -> None:
        self.run = run
        self.spec = spec
        self.session = session
        self.journal = journal
        self.position = 0
        self.last_key = ""
        self.restored_checkpoint = ""
        self.damaged_checkpoints: tuple[str, ...] = ()  # passed over by the restart's recovery
        self.keep_checkpoints: int | None = None  # retention: None keeps every checkpoint

    @classmethod
    def restore(cls, run: RunDirectory, spec: RunSpec, session: TrainingSession) -> ActiveRun:
        """Reopen ``run`` on a fresh ``session`` at its latest checkpoint (see recovery)."""
        active = cls(run, spec, session, Journal(run.journal_path))
        damaged: list[str] = []
        latest = latest_checkpoint(run, spec.run_id, damaged=damaged)
        active.damaged_checkpoints = tuple(damaged)
        active.position, active.last_key = restore_into(session, active.journal, latest)
        active.restored_checkpoint = latest.path.name if latest else ""
        active.drop_forgotten_exports()
        logger.info(
            "run %s restored at position %d (checkpoint %s, step %d, %s)",
            spec.run_id,
            active.position,
            active.restored_checkpoint or "none",
            session.step,
            session.state_digest(),
        )
        return active

    def drop_forgotten_exports(self) -> None:
        """Remove the exports whose latest writer the restart rolled back: they belong to a
        timeline the journal forgot (a replayed LoadWeights("export:e") must not read them).
        The rolled-back ExportWeights writes them again, the same bits, when it is replayed."""
        latest: dict[str, JournalEntry] = {}
        for entry in self.journal.entries(include_rolled_back=True):
            if entry.kind == EXPORT_WEIGHTS:
                name = entry.result.get("name", "")
                if name not in latest or entry.position >= latest[name].position:
                    latest[name] = entry
        for name, entry in latest.items():
            path = self.run.export(name)
            if entry.rolled_back and path.exists():
                shutil.rmtree(path)
                logger.info(
                    "export %s of rolled-back operation %r removed", name, entry.operation_key
                )

    def info(
        self, state: str = outcomes.OPEN, *, digest_known_only: bool = False
    ) -> outcomes.SessionInfo:
        """The run's state; ``digest_known_only`` skips hashing (the digest only if cached)."""
        session = self.session
        return outcomes.SessionInfo(
            run_id=self.spec.run_id,
            config_fingerprint=self.spec.config_fingerprint,
            step=session.step,
            last_operation_key=self.last_key,
            state_digest=session.known_state_digest()
            if digest_known_only
            else session.state_digest(),
            position=self.position,
            restored_checkpoint=self.restored_checkpoint,
            damaged_checkpoints=self.damaged_checkpoints,
            device=str(session.device),
            state=state,
            pending_microbatches=session.accumulated,
            max_steps=session.max_steps or 0,
            plan_fingerprint=self.spec.plan_fingerprint,
        )

    # -- the keyed path ----------------------------------------------------------------------------

    def apply_keyed(
        self, kind: str, op: OperationSpec, payload_digest: str, call: EngineCall
    ) -> tuple[OperationOutcome, Durable]:
        """Journal lookup, position check, ``call``, commit: in that order.

        Returns the outcome and the commit it waits on (None when already on disk). The caller
        must wait for it before anyone hears of the outcome, but not on the executor: the next
        operation runs while this one's fsync completes (group commit). A commit that fails
        raises ``JournalCommitFailed`` there (only a restart makes journal and engine agree).
        """
        entry = self.journal.lookup(op.key)
        if entry is not None:
            return self._replay(entry, kind, payload_digest, op), self.journal.durable(op.key)
        if op.expected_position is not None and op.expected_position != self.position:
            raise PositionMismatch(
                f"expected_position {op.expected_position}, but the session is at position "
                f"{self.position} (last operation {self.last_key!r}); resume from "
                f"position {self.position}",
                self.position,
            )
        applying = Applying(kind, op.key, self.position + 1, payload_digest)
        outcome = applying.outcome(call(applying))
        if op.include_digest and not outcome.state_digest:
            outcome = dataclasses.replace(outcome, state_digest=self.session.state_digest())
        durable = self.journal.commit_async(applying.entry(outcome))
        self.position, self.last_key = applying.position, applying.key
        return outcome, durable

    def _replay(
        self, entry: JournalEntry, kind: str, payload_digest: str, op: OperationSpec
    ) -> OperationOutcome:
        if entry.kind != kind or entry.payload_sha256 != payload_digest:
            raise AlreadyExists(
                f"operation key {op.key!r} was already used for another {entry.kind} payload "
                f"(applied as operation {entry.position}); send a new key for a new operation"
            )
        outcome = outcome_from_record(OUTCOME_TYPES[kind], entry.result, replayed=True)
        if op.include_digest and not outcome.state_digest and entry.position == self.position:
            outcome = dataclasses.replace(outcome, state_digest=self.session.state_digest())
        return outcome

    # -- what each operation does to the engine --------------------------------------------------

    def forward(self, examples: Examples, loss: LossChoice) -> outcomes.ForwardOutcome:
        result = self.session.forward(examples, loss_fn=loss[0], loss_fn_config=loss[1])
        if isinstance(result, TokenOutput):
            return outcomes.ForwardOutcome(result.loss, (), *_token_fields(result))
        predictions = tuple(
            outcomes.Prediction(p.label, tuple(p.scores)) for p in result.predictions
        )
        return outcomes.ForwardOutcome(result.loss, predictions)

    def forward_backward(self, examples: Examples, loss: LossChoice) -> Fields:
        result = self.session.forward_backward(examples, loss_fn=loss[0], loss_fn_config=loss[1])
        fields: Fields = {"token_count": self.session.last_token_count}
        if isinstance(result, TokenOutput):
            logprobs, metrics = _token_fields(result)
            return {**fields, "loss": result.loss, "logprobs": logprobs, "metrics": metrics}
        return {**fields, "loss": result}

    def optim_step(self, learning_rate: float | None, sum_microbatches: bool = False) -> Fields:
        r = self.session.optim_step(learning_rate=learning_rate, sum_microbatches=sum_microbatches)
        return {"step": r.step, "learning_rate": r.learning_rate, "grad_norm": r.grad_norm}

    def save_state(self, name: str, applying: Applying) -> Fields:
        """The checkpoint carries its own journal entry: recovery restores it and re-commits it."""
        session = self.session
        fields = {"state_digest": session.state_digest(), "name": name, "step": session.step}
        entry = applying.entry(applying.outcome(fields))
        path = self.run.checkpoint(name)
        try:
            session.save_state(path, extra=checkpoint_extra(self.spec.run_id, entry))
        except Exception:
            if not written_by(path, entry):
                raise  # nothing became visible: the save did not happen
            # The checkpoint is in place (a step after its rename failed, e.g. the directory's
            # fsync): recovery would restore it at this position, so the save counts as applied.
            logger.exception("save_state %r failed after its checkpoint was in place", name)
        if self.keep_checkpoints:
            protected = {name, *KEPT_CHECKPOINT_NAMES}
            prune_checkpoints(self.run, self.spec.run_id, self.keep_checkpoints, protected)
        return fields

    def load_state(self, name: str) -> Fields:
        self.session.load_state(self.run.checkpoint(name))
        self.restored_checkpoint = name
        return {"name": name, "step": self.session.step}

    def load_weights(self, source: outcomes.WeightsSource, model_path: Path | None) -> Fields:
        """From this run's checkpoint or export, or ``model_path`` (already under the root)."""
        if source.kind == "checkpoint":
            path = self.run.checkpoint(source.value)
        elif source.kind == "export":
            path = self.run.export(source.value)
        else:
            assert model_path is not None
            path = model_path
        self.session.load_weights(path)
        return {}

    def export_weights(self, name: str, checkpoint: str) -> Fields:
        target = self.run.export(name)
        if checkpoint:
            source = self.run.checkpoint(checkpoint)
            if not source.is_dir():
                raise NotFound(f"no checkpoint named {checkpoint!r}; save_state it first")
            self.session.export_checkpoint_weights(source, target)
        else:
            self.session.export_weights(target)
        adapter = self.spec.config.get("lora") is not None
        return {
            "name": name,
            "format": outcomes.FORMAT_ADAPTER if adapter else outcomes.FORMAT_FULL,
            "files": list_export_files(target),
        }
