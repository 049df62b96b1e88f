"""The active run: its folder, spec, engine and journal, and where it stands (its position).

What the operations of the table (``operations``, ``reads``) are applied to; the path a keyed
operation takes through it is ``keyed_path``'s. ``Applying`` tells the operation that needs it
(SaveState, which embeds its own journal entry in the checkpoint) where it will land.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract import outcomes
from trainwire.contract.outcomes import OperationOutcome
from trainwire.server.engine.session import TrainingSession
from trainwire.server.service.journal import Journal, JournalEntry, outcome_record
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
    """The keyed operation being applied: its kind and outcome type, key, the position it will
    have and the digest of its payload."""

    kind: str
    outcome_type: type[OperationOutcome]
    key: str
    position: int
    payload_digest: str

    def outcome(self, fields: dict[str, Any]) -> OperationOutcome:
        return self.outcome_type(self.key, self.position, **fields)

    def entry(self, outcome: OperationOutcome) -> JournalEntry:
        """The journal entry that commits ``outcome``."""
        return JournalEntry(
            self.key, self.kind, self.payload_digest, self.position, outcome_record(outcome)
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
        # The requests of other runs that a restart would replay from this run's checkpoint
        # ``name`` (as a refusal names them): a SaveState does not write over it while any
        # does. The host asks its transports (``SessionHost.checkpoint_readers``).
        self.checkpoint_readers: Callable[[str], list[str]] = lambda name: []

    @property
    def model_root(self) -> Path | None:
        """Where model paths resolve (the session's, which the host resolved)."""
        return self.session.model_root

    @classmethod
    def restore(
        cls, run: RunDirectory, spec: RunSpec, session: TrainingSession, journal: Journal
    ) -> ActiveRun:
        """Reopen ``run`` on a fresh ``session`` at its latest checkpoint, aligning its
        ``journal`` with it (see recovery)."""
        active = cls(run, spec, session, journal)
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
