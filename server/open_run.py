"""One open run: its folder, record, engine and journal, and what each operation does to them.

The session host decides *whether* an operation runs (lifecycle, journal, position) and holds the
lock; ``OpenRun`` applies it to the engine and says what it returned. Each state-changing method
takes ``(key, position, payload_digest, ...)``: the key it runs under, the position it will have,
and the digest the journal records.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from trainwire.client import outcomes
from trainwire.client.config import InputExample
from trainwire.client.outcomes import CheckpointOutcome
from trainwire.server import journal as journal_records
from trainwire.server.errors import NotFound
from trainwire.server.journal import Journal, JournalEntry
from trainwire.server.recovery import latest_checkpoint, restore_into
from trainwire.server.session import TrainingSession
from trainwire.server.state_dir import RunDirectory, RunRecord, list_export_files

logger = logging.getLogger(__name__)

SERVER_EXTRA_KEY = "server"  # the checkpoint extra's key the server owns; others stay untouched


class OpenRun:
    """The run a server has open; ``position`` counts the state-changing operations applied."""

    def __init__(
        self, run: RunDirectory, record: RunRecord, session: TrainingSession, journal: Journal
    ) -> None:
        self.run = run
        self.record = record
        self.session = session
        self.journal = journal
        self.position = 0
        self.last_key = ""
        self.restored_checkpoint = ""

    @classmethod
    def restore(cls, run: RunDirectory, record: RunRecord, session: TrainingSession) -> OpenRun:
        """Reopen ``run`` on a fresh ``session`` at its latest checkpoint (see recovery)."""
        opened = cls(run, record, session, Journal(run.journal_path))
        latest = latest_checkpoint(run, record.run_id, SERVER_EXTRA_KEY)
        opened.position, opened.last_key = restore_into(session, opened.journal, latest)
        opened.restored_checkpoint = latest.path.name if latest else ""
        logger.info(
            "run %s restored at position %d (checkpoint %s, step %d, %s)",
            record.run_id,
            opened.position,
            opened.restored_checkpoint or "none",
            session.step,
            session.state_digest(),
        )
        return opened

    def info(self, state: str = outcomes.OPEN) -> outcomes.SessionInfo:
        session = self.session
        return outcomes.SessionInfo(
            run_id=self.record.run_id,
            config_fingerprint=self.record.config_fingerprint,
            step=session.step,
            last_operation_key=self.last_key,
            state_digest=session.state_digest(),
            position=self.position,
            restored_checkpoint=self.restored_checkpoint,
            device=str(session.device),
            state=state,
            pending_microbatches=session.accumulated,
            max_steps=session.max_steps or 0,
            plan_fingerprint=self.record.plan_fingerprint,
        )

    def commit(self, entry: JournalEntry) -> None:
        """Journal an applied operation durably, then move the position to it."""
        self.journal.record(entry)
        self.position, self.last_key = entry.position, entry.operation_key

    def forward(self, examples: Sequence[InputExample]) -> outcomes.ForwardOutcome:
        result = self.session.forward(examples)
        predictions = tuple(
            outcomes.Prediction(p.label, tuple(p.scores)) for p in result.predictions
        )
        return outcomes.ForwardOutcome(result.loss, predictions)

    # -- state-changing operations -----------------------------------------------------------------

    def forward_backward(
        self, key: str, position: int, digest: str, examples: Sequence[InputExample]
    ) -> outcomes.ForwardBackwardOutcome:
        loss = self.session.forward_backward(examples)
        tokens = self.session.last_token_count
        return outcomes.ForwardBackwardOutcome(key, position, loss=loss, token_count=tokens)

    def optim_step(self, key: str, position: int, digest: str) -> outcomes.OptimStepOutcome:
        r = self.session.optim_step()
        return outcomes.OptimStepOutcome(
            key, position, step=r.step, learning_rate=r.learning_rate, grad_norm=r.grad_norm
        )

    def save_state(self, key: str, position: int, digest: str, name: str) -> CheckpointOutcome:
        """The checkpoint carries its own journal entry: recovery restores it and re-records it."""
        session = self.session
        outcome = outcomes.CheckpointOutcome(
            key, position, state_digest=session.state_digest(), name=name, step=session.step
        )
        server = {
            "run_id": self.record.run_id,
            "position": position,
            "operation_key": key,
            "payload_sha256": digest,
            "result": journal_records.outcome_record(outcome),
        }
        session.save_state(self.run.checkpoint(name), extra={SERVER_EXTRA_KEY: server})
        return outcome

    def load_state(self, key: str, position: int, digest: str, name: str) -> CheckpointOutcome:
        self.session.load_state(self.run.checkpoint(name))
        self.restored_checkpoint = name
        return outcomes.CheckpointOutcome(key, position, name=name, step=self.session.step)

    def load_weights(
        self,
        key: str,
        position: int,
        digest: str,
        source: outcomes.WeightsSource,
        model_path: Path | None,
    ) -> outcomes.OperationOutcome:
        """From this run's checkpoint or export, or ``model_path`` (already under the root)."""
        if source.kind == "checkpoint":
            path = self.run.checkpoint(source.value)
        elif source.kind == "export":
            path = self.run.export(source.value)
        else:
            assert model_path is not None
            path = model_path
        self.session.load_weights(path)
        return outcomes.OperationOutcome(key, position)

    def export_weights(
        self, key: str, position: int, digest: str, name: str, checkpoint: str
    ) -> outcomes.ExportOutcome:
        target = self.run.export(name)
        if checkpoint:
            source = self.run.checkpoint(checkpoint)
            if not source.is_dir():
                raise NotFound(f"no checkpoint named {checkpoint!r}; save_state it first")
            self.session.export_checkpoint_weights(source, target)
        else:
            self.session.export_weights(target)
        adapter = self.record.config.get("lora") is not None
        return outcomes.ExportOutcome(
            key,
            position,
            name=name,
            format=outcomes.FORMAT_ADAPTER if adapter else outcomes.FORMAT_FULL,
            files=list_export_files(target),
        )
