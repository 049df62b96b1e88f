"""The session host: one TrainingSession behind a durable journal, one operation at a time.

Plain Python, no gRPC: the servicer decodes a request, calls one method here and encodes what it
returns; tests drive this class directly.

Lifecycle: idle → (Open) open → (Close) closed → (Open of a new run id) open ... A server started
on a state directory that holds an open run is ``restoring`` until ``recover()`` has reopened it
from its latest checkpoint (``failed`` if that goes wrong).

The state directory (names are constants in ``trainwire.server.state_dir``)::

    <state dir>/
      server.lock              held (flock) by the one server using the directory
      runs/<run_id>/
        run.json               run id, config and fingerprints, max_steps, plan, open | closed
        journal.sqlite3        the operation journal (WAL: also -wal and -shm beside it)
        checkpoints/<name>/    session checkpoints written by SaveState
        exports/<name>/        inference exports written by ExportWeights

Each run's files stay apart, so a closed run's checkpoints and journal survive the next run; at
most one run is open. Run ids, checkpoint and export names match
``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` and must resolve inside their folder (no symlink escapes);
model paths resolve under the model root.

Every state-changing operation (ForwardBackward, OptimStep, SaveState, LoadState, LoadWeights,
ExportWeights) runs under the one executor lock, in this order, and moves the session's
*position* (operations applied) by one:

1. the journal: the key seen with the same payload digest → the recorded result, nothing runs;
   the same key with another payload → ALREADY_EXISTS;
2. ``expected_position`` differs from the position → FAILED_PRECONDITION (``PositionMismatch``);
3. the engine runs it (an engine error changes nothing and is not journaled);
4. the journal commits it durably with its position; only then does the caller hear of it.

Recovery: a SaveState checkpoint carries ``{"server": {run_id, position, operation_key, ...}}``
in its ``extra``. On restart the checkpoint with the highest position is restored, the journal
entries after it are rolled back (their keys run again when replayed), and the checkpoint's own
entry is re-inserted if a crash lost it. No checkpoint: a fresh session at position 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any, TypeVar

from trainwire.client import outcomes
from trainwire.client.config import InputExample, TrainingConfig, canonical_json, sha256_fingerprint
from trainwire.client.outcomes import OperationOutcome, OperationSpec, SessionInfo
from trainwire.server import journal as journal_records
from trainwire.server.device import resolve_device
from trainwire.server.errors import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from trainwire.server.journal import Journal, JournalEntry
from trainwire.server.model_loading import resolve_under
from trainwire.server.open_run import OpenRun
from trainwire.server.session import TrainingSession
from trainwire.server.state_dir import RUN_CLOSED, RunRecord, StateDirectory, check_name

logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 1024
T = TypeVar("T")


class PositionMismatch(FailedPrecondition):
    """``expected_position`` is not where the session is; ``position`` is where it is."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


def payload_digest(kind: str, payload: dict[str, Any]) -> str:
    """What a reused key is compared by: the operation kind and its payload, never its Operation."""
    return sha256_fingerprint(canonical_json({"kind": kind, "payload": payload}))


class SessionHost:
    """Owns the state directory and the one session in it.

    Args:
        state_dir: where runs live (created if needed).
        model_root: model paths (the config's ``model``, LoadWeights ``model_path``) resolve under
            it; None allows any local path.
        device: ``cpu``, ``cuda`` or ``cuda:N``; None is CUDA where there is one.
        on_serving: called with True/False when the host can/cannot take operations (health).
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        model_root: str | Path | None = None,
        device: str | None = None,
        on_serving: Callable[[bool], None] | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.model_root = None if model_root is None else Path(model_root).resolve()
        self.state_dir = StateDirectory(state_dir)  # held by this host until release()
        self.on_serving = on_serving
        # The executor: every session operation runs on this one thread, in arrival order, so
        # nothing interleaves inside the engine and torch always runs on the same thread.
        self._worker = futures.ThreadPoolExecutor(1, thread_name_prefix="trainwire-session")
        self._released = False
        self._open: OpenRun | None = None
        self._closed_info: SessionInfo | None = None
        self._failure = ""
        self._shutting_down = False
        self.phase = outcomes.IDLE
        open_runs = self.state_dir.open_runs()
        self._pending = open_runs[0] if len(open_runs) == 1 else None
        if self._pending is not None:
            self.phase = outcomes.RESTORING
        elif open_runs:
            self._fail(f"{len(open_runs)} runs are recorded open: {[r.run_id for r in open_runs]}")

    # -- lifecycle -------------------------------------------------------------------------------

    def recover(self) -> None:
        """Reopen the run a previous server left open (a no-op when there is none)."""
        self._serialized(self._recover, refusable=False)

    def _recover(self) -> None:
        record = self._pending
        if record is None:
            self._set_serving(self.phase != outcomes.FAILED)
            return
        self._set_serving(False)
        try:
            session = self._new_session(TrainingConfig.from_dict(record.config), record.max_steps)
            self._open = OpenRun.restore(self.state_dir.run(record.run_id), record, session)
        except Exception as error:
            logger.exception("restoring run %s failed", record.run_id)
            self._fail(f"restoring run {record.run_id!r} failed: {error}")
            return
        finally:
            self._pending = None
        self.phase = outcomes.OPEN
        self._set_serving(True)

    def open(
        self, run_id: str, config_json: str, max_steps: int, plan_fingerprint: str = ""
    ) -> outcomes.OpenOutcome:
        """Open the session for a run, or confirm the open one (see the proto's Open)."""
        check_name(run_id, "run id")
        config = _parse_config(config_json)
        if max_steps < 0:
            raise InvalidArgument(f"max_steps must be positive (or 0: none), got {max_steps}")
        record = RunRecord(
            run_id, config.to_dict(), config.fingerprint(), max_steps or None, plan_fingerprint
        )
        return self._serialized(self._open_run, record, config)

    def _open_run(self, record: RunRecord, config: TrainingConfig) -> outcomes.OpenOutcome:
        run_id = record.run_id
        if self.phase == outcomes.OPEN:
            _refuse_another_session(self._require_open().record, record)
            return _opened(self._require_open().info(), created=False)
        self._refuse_unless(outcomes.IDLE, outcomes.CLOSED)
        run = self.state_dir.run(run_id)
        if run.exists():
            raise FailedPrecondition(
                f"run {run_id!r} was closed on this server; open a new run id to train again"
            )
        self._set_serving(False)
        try:
            session = self._new_session(config, record.max_steps)
        finally:
            self._set_serving(True)
        run.write_record(record)  # only once the session loaded: a refused config leaves none
        self._open = OpenRun(run, record, session, Journal(run.journal_path))
        self.phase = outcomes.OPEN
        logger.info("run %s opened (%s, %s)", run_id, config.fingerprint(), session.device)
        return _opened(self._open.info(), created=True)

    def close(self) -> SessionInfo:
        """Close the open run (a no-op unless one is open); its files stay in the state dir."""
        return self._serialized(self._close, refusable=False)

    def _close(self) -> SessionInfo:
        if self.phase != outcomes.OPEN:
            return self._idle_info()
        opened = self._require_open()
        info = opened.info(state=outcomes.CLOSED)
        opened.run.write_record(dataclasses.replace(opened.record, state=RUN_CLOSED))
        opened.journal.close()
        self._open, self._closed_info, self.phase = None, info, outcomes.CLOSED
        logger.info("run %s closed at position %d", info.run_id, info.position)
        return info

    def info(self) -> SessionInfo:
        """Where the session stands; waits for an operation in flight, never for a restore."""
        if self.phase != outcomes.OPEN:
            return self._idle_info()
        return self._serialized(
            lambda: self._open.info() if self._open is not None else self._idle_info(),
            refusable=False,
        )

    def begin_shutdown(self) -> None:
        """Refuse new operations (UNAVAILABLE); the one in flight finishes and commits."""
        self._shutting_down = True
        self._set_serving(False)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no operation runs; False if ``timeout_s`` passed first."""
        try:
            self._worker.submit(lambda: None).result(timeout=timeout_s)
        except futures.TimeoutError:
            return False
        return True

    def release(self) -> None:
        """Close the journal and let go of the state directory (after ``wait_idle``)."""
        if self._released:
            return
        self._released = True

        def release() -> None:
            if self._open is not None:
                self._open.journal.close()
            self.state_dir.release()

        self._worker.submit(release).result()
        self._worker.shutdown()

    @property
    def journal(self) -> Journal | None:
        """The open run's journal (None when no run is open)."""
        return None if self._open is None else self._open.journal

    @property
    def session(self) -> TrainingSession | None:
        """The open run's engine (None when no run is open)."""
        return None if self._open is None else self._open.session

    # -- operations ------------------------------------------------------------------------------

    def forward(self, examples: Sequence[InputExample]) -> outcomes.ForwardOutcome:
        return self._serialized(lambda: self._require_open().forward(examples))

    def forward_backward(
        self, examples: Sequence[InputExample], op: OperationSpec
    ) -> outcomes.ForwardBackwardOutcome:
        payload = {"examples": [example.to_dict() for example in examples]}
        cls = outcomes.ForwardBackwardOutcome
        return self._keyed("ForwardBackward", op, payload, cls, OpenRun.forward_backward, examples)

    def optim_step(self, op: OperationSpec) -> outcomes.OptimStepOutcome:
        return self._keyed("OptimStep", op, {}, outcomes.OptimStepOutcome, OpenRun.optim_step)

    def save_state(self, name: str, op: OperationSpec) -> outcomes.CheckpointOutcome:
        check_name(name, "checkpoint")
        return self._keyed(
            "SaveState", op, {"name": name}, outcomes.CheckpointOutcome, OpenRun.save_state, name
        )

    def load_state(self, name: str, op: OperationSpec) -> outcomes.CheckpointOutcome:
        check_name(name, "checkpoint")
        return self._keyed(
            "LoadState", op, {"name": name}, outcomes.CheckpointOutcome, OpenRun.load_state, name
        )

    def load_weights(self, source: outcomes.WeightsSource, op: OperationSpec) -> OperationOutcome:
        """From a checkpoint or export of this run, or a model path under the model root."""
        model_path = None
        if source.kind in ("checkpoint", "export"):
            check_name(source.value, source.kind)
        elif source.kind == "model_path":
            model_path = resolve_under(self.model_root, source.value, "model path")
        else:
            raise InvalidArgument(
                f"weights source {source.kind!r}: use {outcomes.WEIGHTS_SOURCE_KINDS}"
            )
        payload = {"kind": source.kind, "value": source.value}
        return self._keyed(
            "LoadWeights", op, payload, OperationOutcome, OpenRun.load_weights, source, model_path
        )

    def export_weights(
        self, name: str, op: OperationSpec, *, checkpoint: str = ""
    ) -> outcomes.ExportOutcome:
        """Write export ``name`` (from ``checkpoint``'s weights when given); ``directory`` is it."""
        check_name(name, "export")
        if checkpoint:
            check_name(checkpoint, "checkpoint")
        payload = {"name": name, "checkpoint": checkpoint}
        outcome = self._keyed(
            "ExportWeights", op, payload, outcomes.ExportOutcome, OpenRun.export_weights, name,
            checkpoint,
        )  # fmt: skip
        return dataclasses.replace(outcome, directory=self._require_open().run.export(name))

    # -- the executor ------------------------------------------------------------------------------

    def _serialized(self, call: Callable[..., T], *args: Any, refusable: bool = True) -> T:
        """``call(*args)`` on the executor thread, after everything queued before it.

        A ``refusable`` call (an operation) is UNAVAILABLE while the server restores or shuts
        down; Info, Close and the restore itself always run.
        """
        if refusable:
            self._refuse_if_unavailable()

        def job() -> T:
            # Checked again when its turn comes: callers queued behind the last one are refused.
            if refusable:
                self._refuse_if_unavailable()
            return call(*args)

        if self._released:
            raise Unavailable("the server has stopped")
        return self._worker.submit(job).result()

    def _keyed(
        self,
        kind: str,
        op: OperationSpec,
        payload: dict[str, Any],
        cls: type[OperationOutcome],
        apply: Callable[..., OperationOutcome],
        *args: Any,
    ) -> Any:
        """Journal lookup, position check, ``apply(open run, key, position, digest, *args)``,
        durable commit: in that order, under the executor lock."""
        _check_key(op.key)
        digest = payload_digest(kind, payload)
        return self._serialized(self._apply_keyed, kind, op, digest, cls, apply, args)

    def _apply_keyed(
        self,
        kind: str,
        op: OperationSpec,
        digest: str,
        cls: type[OperationOutcome],
        apply: Callable[..., OperationOutcome],
        args: tuple[Any, ...],
    ) -> Any:
        opened = self._require_open()
        entry = opened.journal.lookup(op.key)
        if entry is not None:
            return self._replay(opened, entry, kind, digest, op, cls)
        if op.expected_position is not None and op.expected_position != opened.position:
            raise PositionMismatch(
                f"expected_position {op.expected_position}, but the session is at position "
                f"{opened.position} (last operation {opened.last_key!r}); resume from "
                f"position {opened.position}",
                opened.position,
            )
        position = opened.position + 1
        try:
            outcome = apply(opened, op.key, position, digest, *args)
        except BaseException:
            if opened.session.broken is not None:
                # Half applied: only a restart, which restores the latest checkpoint, makes the
                # session trustworthy again. Health goes NOT_SERVING so a supervisor restarts it.
                self._fail(f"{opened.session.broken}; restart the server to restore")
            raise
        if op.include_digest and not outcome.state_digest:
            outcome = dataclasses.replace(outcome, state_digest=opened.session.state_digest())
        record = journal_records.outcome_record(outcome)
        try:
            opened.commit(JournalEntry(op.key, kind, digest, position, record))
        except Exception as error:
            # The engine moved on but the journal did not: only a restart makes them agree.
            self._fail(f"the journal could not record {op.key!r}: {error}")
            raise FailedPrecondition(f"{self._failure}; restart the server") from None
        return outcome

    def _replay(
        self,
        opened: OpenRun,
        entry: JournalEntry,
        kind: str,
        digest: str,
        op: OperationSpec,
        cls: type[OperationOutcome],
    ) -> OperationOutcome:
        if entry.kind != kind or entry.payload_sha256 != digest:
            raise AlreadyExists(
                f"operation key {op.key!r} was already used for another {entry.kind} payload "
                f"(applied as operation {entry.position}); send a new key for a new operation"
            )
        outcome = journal_records.outcome_from_record(cls, entry.result, replayed=True)
        if op.include_digest and not outcome.state_digest and entry.position == opened.position:
            outcome = dataclasses.replace(outcome, state_digest=opened.session.state_digest())
        return outcome

    # -- helpers ---------------------------------------------------------------------------------

    def _new_session(self, config: TrainingConfig, max_steps: int | None) -> TrainingSession:
        return TrainingSession(
            config, device=self.device, max_steps=max_steps, model_root=self.model_root
        )

    def _require_open(self) -> OpenRun:
        self._refuse_unless(outcomes.OPEN)
        assert self._open is not None
        return self._open

    def _refuse_unless(self, *phases: str) -> None:
        if self.phase in phases:
            return
        if self.phase == outcomes.RESTORING:
            raise Unavailable("the server is restoring its session after a restart; retry shortly")
        if self.phase == outcomes.FAILED:
            # A restart restores the latest checkpoint: callers retry until it has happened.
            raise Unavailable(f"the server cannot serve its session: {self._failure}")
        if self.phase == outcomes.CLOSED:
            raise FailedPrecondition("the session was closed; Open a new run id first")
        raise FailedPrecondition("no session is open; call Open first")

    def _refuse_if_unavailable(self) -> None:
        if self._shutting_down:
            raise Unavailable("the server is shutting down; retry against its replacement")
        if self.phase == outcomes.RESTORING:
            raise Unavailable("the server is restoring its session after a restart; retry shortly")

    def _idle_info(self) -> SessionInfo:
        if self.phase == outcomes.CLOSED and self._closed_info is not None:
            return self._closed_info
        run_id = self._pending.run_id if self._pending else ""
        return SessionInfo(run_id=run_id, device=str(self.device), state=self.phase)

    def _fail(self, message: str) -> None:
        self._failure = message
        self.phase = outcomes.FAILED
        self._set_serving(False)
        logger.error("session unusable: %s", message)

    def _set_serving(self, serving: bool) -> None:
        if self.on_serving is not None:
            self.on_serving(serving and not self._shutting_down and self.phase != outcomes.FAILED)


def _opened(info: SessionInfo, *, created: bool) -> outcomes.OpenOutcome:
    return outcomes.OpenOutcome(**dataclasses.asdict(info), created=created)


def _check_key(key: str) -> None:
    if not key:
        raise InvalidArgument("operation_key is required: send a stable key for every operation")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArgument(
            f"operation_key is {len(key)} characters; the limit is {MAX_KEY_CHARS}"
        )


def _parse_config(config_json: str) -> TrainingConfig:
    try:
        data = json.loads(config_json)
    except ValueError as error:
        raise InvalidArgument(f"config_json is not valid JSON: {error}") from None
    try:
        return TrainingConfig.from_dict(data)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def _refuse_another_session(current: RunRecord, requested: RunRecord) -> None:
    """FAILED_PRECONDITION naming every way ``requested`` differs from the open session."""
    if current.run_id != requested.run_id:
        raise FailedPrecondition(
            f"the server's session is open for run {current.run_id!r}, not {requested.run_id!r}; "
            "close it first or use another server"
        )
    differences = current.differences(requested)
    if differences:
        raise FailedPrecondition(
            f"run {current.run_id!r} is open with another {'; another '.join(differences)}. "
            "Use a new run id for a new configuration"
        )
