"""The active run: its folder, spec, engine and journal, and the one path every keyed operation
takes through them.

The session host decides *whether* a run may take operations (lifecycle) and runs them on its
executor; ``ActiveRun.apply_keyed`` decides what a keyed operation does, in this order:

1. the journal: the key seen with the same payload digest → the journaled result, nothing runs;
   the same key with another payload → ALREADY_EXISTS;
2. ``expected_position`` differs from the position → FAILED_PRECONDITION (``PositionMismatch``);
3. the operation's ``apply`` (``operations``) calls the engine (an engine error changes nothing
   and is not journaled);
4. the journal commits it durably with its position; only then does the caller hear of it.

``Applying`` tells the operation that needs it (SaveState, which embeds its own journal entry in
the checkpoint) where it will land.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract import outcomes
from trainwire.contract.outcomes import OperationOutcome, OperationSpec
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import AlreadyExists, PositionMismatch
from trainwire.server.service.journal import (
    Journal,
    JournalEntry,
    outcome_from_record,
    outcome_record,
)
from trainwire.server.service.operations import Fields, Operation
from trainwire.server.service.recovery import drop_forgotten_exports, restore_into
from trainwire.server.service.run_checkpoints import latest_checkpoint
from trainwire.server.service.state_dir import RunDirectory, RunSpec

logger = logging.getLogger(__name__)

Durable = futures.Future[None] | None  # an outcome's pending commit


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
    """The keyed operation being applied: its operation, key, the position it will have and the
    digest of its payload."""

    operation: Operation[Any]
    key: str
    position: int
    payload_digest: str

    def outcome(self, fields: Fields) -> OperationOutcome:
        return self.operation.outcome_type(self.key, self.position, **fields)

    def entry(self, outcome: OperationOutcome) -> JournalEntry:
        """The journal entry that commits ``outcome``."""
        return JournalEntry(
            self.key,
            self.operation.kind,
            self.payload_digest,
            self.position,
            outcome_record(outcome),
        )


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

    @property
    def model_root(self) -> Path | None:
        """Where model paths resolve (the session's, which the host resolved)."""
        return self.session.model_root

    @classmethod
    def restore(cls, run: RunDirectory, spec: RunSpec, session: TrainingSession) -> ActiveRun:
        """Reopen ``run`` on a fresh ``session`` at its latest checkpoint (see recovery)."""
        active = cls(run, spec, session, Journal(run.journal_path))
        damaged: list[str] = []
        latest = latest_checkpoint(run, spec.run_id, damaged=damaged)
        active.damaged_checkpoints = tuple(damaged)
        active.position, active.last_key = restore_into(session, active.journal, latest)
        active.restored_checkpoint = latest.path.name if latest else ""
        drop_forgotten_exports(run, active.journal)
        logger.info(
            "run %s restored at position %d (checkpoint %s, step %d, %s)",
            spec.run_id,
            active.position,
            active.restored_checkpoint or "none",
            session.step,
            session.state_digest(),
        )
        return active

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

    def wait_for_journal(self) -> None:
        """Block until every operation applied so far is durable in the journal.

        A checkpoint may only hold operations the journal holds: a SaveState that followed an
        operation whose group commit is still on its way would otherwise write a checkpoint
        containing it, and a crash before the commit would restore it applied but unjournaled,
        so its re-sent call would apply it twice. ``JournalCommitFailed`` if a commit failed.
        """
        try:
            self.journal.wait_all_durable()
        except Exception as error:
            raise JournalCommitFailed(
                f"the journal could not record an operation: {error}"
            ) from error

    # -- the keyed path ----------------------------------------------------------------------------

    def apply_keyed(
        self, operation: Operation[Any], request: Any, op: OperationSpec, payload_digest: str
    ) -> tuple[Any, Durable]:
        """Journal lookup, position check, ``operation.apply``, commit: in that order.

        Returns the outcome and the commit it waits on (None when already on disk). The caller
        must wait for it before anyone hears of the outcome, but not on the executor: the next
        operation runs while this one's fsync completes (group commit). A commit that fails
        raises ``JournalCommitFailed`` there (only a restart makes journal and engine agree).
        """
        entry = self.journal.lookup(op.key)
        if entry is not None:
            outcome = self._replay(entry, operation, payload_digest, op)
            durable = self.journal.durable(op.key)
        else:
            outcome, durable = self._apply_new(operation, request, op, payload_digest)
        if operation.complete is not None:
            outcome = operation.complete(self, request, outcome)
        return outcome, durable

    def _apply_new(
        self, operation: Operation[Any], request: Any, op: OperationSpec, payload_digest: str
    ) -> tuple[OperationOutcome, Durable]:
        if op.expected_position is not None and op.expected_position != self.position:
            raise PositionMismatch(
                f"expected_position {op.expected_position}, but the session is at position "
                f"{self.position} (last operation {self.last_key!r}); resume from "
                f"position {self.position}",
                self.position,
            )
        applying = Applying(operation, op.key, self.position + 1, payload_digest)
        outcome = applying.outcome(operation.apply(self, request, applying))
        if op.include_digest and not outcome.state_digest:
            outcome = dataclasses.replace(outcome, state_digest=self.session.state_digest())
        durable = self.journal.commit_async(applying.entry(outcome))
        self.position, self.last_key = applying.position, applying.key
        return outcome, durable

    def _replay(
        self, entry: JournalEntry, operation: Operation[Any], payload_digest: str, op: OperationSpec
    ) -> OperationOutcome:
        if entry.kind != operation.kind or entry.payload_sha256 != payload_digest:
            raise AlreadyExists(
                f"operation key {op.key!r} was already used for another {entry.kind} payload "
                f"(applied as operation {entry.position}); send a new key for a new operation"
            )
        outcome = outcome_from_record(operation.outcome_type, entry.result, replayed=True)
        if op.include_digest and not outcome.state_digest and entry.position == self.position:
            outcome = dataclasses.replace(outcome, state_digest=self.session.state_digest())
        return outcome
