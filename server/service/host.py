"""The session host: the open runs of one state directory, their lifecycle and their files.

Plain Python, no gRPC: each transport decodes its requests into the typed requests of the
operation table (``operations``) and submits each as a ``Command`` (``submit``; a gRPC handler
waits on its ticket through ``apply``, the Tinker intake answers its request id from it); how a
command becomes the scheduler's job is ``command_queue``'s. The host holds the runs: which are
open (one, or up to ``max_runs`` LoRA runs sharing one base in memory), opening, closing and
restoring them (its phases, idle, restoring, open, closed, failed, are the ``Lifecycle``'s; a
server started on a state directory that holds open runs is ``restoring`` until ``recover()``
has reopened them from their latest checkpoints), copying and discarding their saved files, and
what a failure means: a session broken midway fails its run alone while other runs are open
(they serve on), and the server where it was the only run; a journal that could not commit
fails the server (a restart restores each run's latest checkpoint; see ``recovery``). The
layout on disk is in ``state_dir``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from trainwire.contract import outcomes
from trainwire.contract.config import TrainingConfig
from trainwire.contract.outcomes import OperationSpec, SessionInfo
from trainwire.server.engine.device import resolve_device
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from trainwire.server.service.active_run import (
    ActiveRun,
    JournalCommitFailed,
    wait_durable,
)
from trainwire.server.service.command_queue import CommandQueue, RunAccess, refusing_if_unavailable
from trainwire.server.service.commands import Applied, Command, Ticket
from trainwire.server.service.journal import (
    Journal,
    forget_run,
)
from trainwire.server.service.ledger import Ledger
from trainwire.server.service.lifecycle import Lifecycle
from trainwire.server.service.operations import Operation
from trainwire.server.service.run_checkpoints import (
    copy_into_run,
    discard_run,
    discard_saved,
)
from trainwire.server.service.sample_batching import PreparedSample
from trainwire.server.service.scheduler import Scheduler
from trainwire.server.service.state_dir import (
    RUN_CLOSED,
    RunSpec,
    StateDirectory,
    check_name,
    refuse_another_run,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How long a request whose expected position is ahead of the run waits with nothing running
# before it goes ahead to be refused with the real position (its predecessor never came).
DEFAULT_IDLE_RELEASE_S = 2.0
SessionFactory = Callable[..., TrainingSession]  # (config, *, device, max_steps, model_root)
RequestT = TypeVar("RequestT")


class SessionHost:
    """Owns the state directory and the runs open in it.

    Args:
        state_dir: where runs live (created if needed).
        model_root: model paths (the config's ``model``, LoadWeights ``model_path``) resolve under
            it; None allows any local path.
        device: ``cpu``, ``cuda`` or ``cuda:N``; None is CUDA where there is one.
        on_serving: called with True/False when the host can/cannot take operations (health).
        keep_checkpoints: retention: after each SaveState keep a run's K newest checkpoints
            (and the one named ``best``); None keeps them all.
        sample_batching: concurrent samples decode together (``sample_batching``); False
            decodes each request alone, for a device whose kernels are not batch-invariant.
        session_factory: builds each session (rank 0 of a group builds it on every rank).
        max_runs: runs open at once. Beyond one, LoRA runs of one base model share its weights
            in memory (``SharedBase``), each with its own adapter, optimizer, RNG, position,
            keys and files; a full-weights run trains alone; the scheduler serves the runs with
            work in turn (``fair_turns.FairTurns``), their numbered requests and samples alike
            (``scheduler``).
    """

    def __init__(
        self,
        state_dir: str | Path,
        *,
        model_root: str | Path | None = None,
        device: str | None = None,
        on_serving: Callable[[bool], None] | None = None,
        keep_checkpoints: int | None = None,
        sample_batching: bool = True,
        session_factory: SessionFactory = TrainingSession,
        max_runs: int = 1,
    ) -> None:
        if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs must be an integer >= 1, got {max_runs!r}")
        self.max_runs = max_runs
        self.device = resolve_device(device)
        self.model_root = None if model_root is None else Path(model_root).resolve()
        if self.model_root is not None and not self.model_root.is_dir():
            raise ValueError(
                f"--model-root {model_root}: no such directory; give the directory that holds "
                "the models (each a save_pretrained directory)"
            )
        self.state_dir = StateDirectory(state_dir)  # held by this host until release()
        try:
            # Damaged (``store_check``), it stops the server at start: every run and every
            # Tinker request would be served from it.
            self.ledger = Ledger(self.state_dir.root)
        except BaseException:
            self.state_dir.release()
            raise
        self.lifecycle = Lifecycle(on_serving)
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1, got {keep_checkpoints}")
        self.keep_checkpoints = keep_checkpoints
        self.sample_batching = sample_batching
        self._session_factory = session_factory
        # A run's share of the scheduler's turns when runs of several tenants wait (the process
        # sets it to the run's tenant's weight); read as a run's turn begins.
        self.run_weight: Callable[[str], float] = lambda run_id: 1.0
        # The one queue every run's work waits in, and its engine thread: a run's positions
        # here, a Tinker model's seq_ids through the intake, samples, reads, lifecycle calls.
        self.scheduler = Scheduler(noun="stream", weight_of=lambda lane: self.run_weight(lane))
        # How a command (either transport's) becomes the scheduler's job for one of the runs.
        runs = RunAccess(
            require=self._require_active,
            find=self._open_run_or_none,
            lane_of=self.lane_of,
            applied=self._applied,
            broke=self._run_broke,
            journal_failed=self.journal_failed,
        )
        self.commands = CommandQueue(self.scheduler, self.lifecycle, runs)
        # Who still reads a run's checkpoint folder, by (run id, folder): the requests of other
        # runs a restart would replay from it (the Tinker front sets it: its loads name other
        # runs' checkpoints). A SaveState of any transport refuses to write over a folder
        # while any does; asked on the engine thread, where loads and saves take turns.
        self.checkpoint_readers: Callable[[str, str], list[str]] = lambda run_id, folder: []
        self._runs: dict[str, ActiveRun] = {}  # the open runs, by run id
        self._snapshots: dict[str, SessionInfo] = {}  # each run as of its last finished operation
        self._shared_base: SharedBase | None = None  # with max_runs > 1: the LoRA runs' base
        # On a server of many runs, a run a restart could not restore, or whose session broke
        # midway, fails alone: why, by run (its calls answer it, and it holds its slot until it
        # is closed).
        self._failed_runs: dict[str, tuple[RunSpec, str]] = {}
        self.idle_release_s = DEFAULT_IDLE_RELEASE_S  # read when a run opens or is restored
        open_runs = self.state_dir.open_runs()
        self._pending: list[RunSpec] = open_runs if len(open_runs) <= max_runs else []
        if self._pending:
            self.lifecycle.phase = outcomes.RESTORING
        elif open_runs:
            self._fail(
                f"{len(open_runs)} runs are recorded open ({[r.run_id for r in open_runs]}), "
                f"more than --max-runs {max_runs}: start the server with --max-runs "
                f"{len(open_runs)} to restore them"
            )

    @property
    def phase(self) -> str:
        """``idle``, ``restoring``, ``open``, ``closed`` or ``failed`` (see ``lifecycle``)."""
        return self.lifecycle.phase

    # -- lifecycle -------------------------------------------------------------------------------

    def recover(self) -> None:
        """Reopen the run a previous server left open (a no-op when there is none)."""
        self._serialized(self._recover, refusable=False)

    def _recover(self) -> None:
        if not self._pending:
            self.lifecycle.set_serving(self.phase != outcomes.FAILED)
            return
        self.lifecycle.set_serving(False)
        try:
            for spec in self._pending:
                try:
                    config = TrainingConfig.from_dict(spec.config)
                    session = self._new_session(config, spec.max_steps)
                    run, journal = self.state_dir.run(spec.run_id), self._journal(spec.run_id)
                    active = ActiveRun.restore(run, spec, session, journal)
                except Exception as error:
                    logger.exception("restoring run %s failed", spec.run_id)
                    reason = f"restoring run {spec.run_id!r} failed: {error}"
                    if self.max_runs == 1:  # the server's one run: a restart is the remedy
                        self._fail(reason)
                        return
                    self._failed_runs[spec.run_id] = (spec, reason)  # the others serve
                    continue
                self._add_run(active, info=active.info(digest_known_only=True))  # restore hashed it
        finally:
            self._pending = []
        self.lifecycle.phase = outcomes.OPEN if self._runs else outcomes.IDLE
        self.lifecycle.set_serving(True)

    def open(
        self,
        run_id: str,
        config: TrainingConfig,
        max_steps: int | None = None,
        plan_fingerprint: str = "",
        *,
        admit: Callable[[], None] | None = None,
        account: str = "",
    ) -> outcomes.OpenOutcome:
        """Open the session for a run, or confirm the open one (None/"" accept the open run's);
        it waits as one of ``account``'s calls (see ``apply``).

        ``admit`` (a tenant's checks: its ``max_runs``, who holds the run id) runs on the
        engine thread right before the open, so no other open or close lands between what it
        counted and the open it admits; what it raises refuses the open, nothing changed. (On
        the callers' threads, opens sent together would each count the runs open before any of
        them landed, and all open.)"""
        check_name(run_id, "run id")
        if max_steps is not None and max_steps < 1:
            raise InvalidArgument(f"max_steps must be a positive integer or None, got {max_steps}")
        spec = RunSpec(run_id, config.to_dict(), config.fingerprint(), max_steps, plan_fingerprint)
        return self._serialized(self._open_run, spec, config, admit, account=account)

    def _open_run(
        self, spec: RunSpec, config: TrainingConfig, admit: Callable[[], None] | None = None
    ) -> outcomes.OpenOutcome:
        if admit is not None:  # first: what it refuses learns nothing of the runs open
            admit()
        run_id = spec.run_id
        if run_id in self._failed_runs:
            self._require_active(run_id)  # answers why it could not be restored
        existing = self._runs.get(run_id)
        if existing is not None or (self.max_runs == 1 and self.phase == outcomes.OPEN):
            active = existing or self._require_active()
            refuse_another_run(active.spec, spec)
            return outcomes.OpenOutcome.from_info(active.info(), created=False)
        if self.phase != outcomes.OPEN:
            self.lifecycle.require(outcomes.IDLE, outcomes.CLOSED)
        if len(self._runs) + len(self._failed_runs) >= self.max_runs:
            raise ResourceExhausted(
                f"this server holds {self.max_runs} runs at once (--max-runs), all open: close "
                "one first, or open this run on another server"
            )
        self._refuse_beside_the_open_runs(config)
        run = self.state_dir.run(run_id)
        if run.exists():
            raise FailedPrecondition(
                f"run {run_id!r} was closed on this server; open a new run id to train again"
            )
        self.lifecycle.set_serving(False)
        try:
            session = self._new_session(config, spec.max_steps)
        finally:
            self.lifecycle.set_serving(True)
        run.write_spec(spec)  # only once the session loaded: a refused config leaves none
        active = ActiveRun(run, spec, session, self._journal(run_id))
        info = active.info()
        self._add_run(active, info=info)
        self.lifecycle.phase = outcomes.OPEN
        logger.info("run %s opened (%s, %s)", run_id, config.fingerprint(), session.device)
        return outcomes.OpenOutcome.from_info(info, created=True)

    def _journal(self, run_id: str) -> Journal:
        """Run ``run_id``'s journal: its rows of the ledger."""
        return Journal(self.ledger, run_id)

    def _add_run(self, active: ActiveRun, *, info: SessionInfo) -> None:
        run_id = active.spec.run_id
        active.keep_checkpoints = self.keep_checkpoints
        active.checkpoint_readers = lambda folder: self.checkpoint_readers(run_id, folder)
        self._runs[run_id] = active
        self._snapshots[run_id] = info
        self._start_positions(run_id)

    def _refuse_beside_the_open_runs(self, config: TrainingConfig) -> None:
        """FAILED_PRECONDITION for a run that cannot train beside the open ones: a full-weights
        run changes the base model the others read, so it trains alone (and a run waits for
        one); a run of another base model is refused when the shared base is fitted
        (``SharedBase.refuse_unfit``, naming the base this server holds)."""
        if not self._runs:
            return
        if config.lora is None:
            raise FailedPrecondition(
                f"a full-weights run changes the base model that the {len(self._runs)} open "
                "run(s) share: it trains alone; close them first, or open it on another server"
            )
        alone = [r.spec.run_id for r in self._runs.values() if r.session.config.lora is None]
        if alone:
            raise FailedPrecondition(
                f"run {alone[0]!r} trains the full weights of the base model and trains alone: "
                "close it first, or open this run on another server"
            )

    def close(self, run_id: str | None = None) -> SessionInfo:
        """Close the open run (a no-op unless one is open); its files stay in the state dir.

        With ``run_id``, only that run: closing it again (or after the server moved on to
        another) is a no-op, so a finished controller can close its run exactly once however
        often it is resumed; another run open is FAILED_PRECONDITION and closes nothing.
        """
        if run_id:
            check_name(run_id, "run id")
        return self._serialized(self._close, run_id, refusable=False)

    def _close(self, run_id: str | None) -> SessionInfo:
        if run_id and run_id in self._failed_runs:
            return self._close_failed(run_id)
        if run_id and (self.phase != outcomes.OPEN or run_id not in self._runs):
            return self._closed_run_info(run_id)
        if self.phase != outcomes.OPEN:
            return self._idle_info()
        active = self._require_active(run_id or "")
        run_id = active.spec.run_id
        info = active.info(state=outcomes.CLOSED)
        active.run.write_spec(dataclasses.replace(active.spec, state=RUN_CLOSED))
        active.journal.close()
        self.scheduler.end_stream(run_id)
        del self._runs[run_id], self._snapshots[run_id]
        self.lifecycle.closed_info = info
        if not self._runs:
            self.lifecycle.phase = outcomes.CLOSED
            self._shared_base = None  # the last run on it closed: its memory goes with it
        logger.info("run %s closed at position %d", info.run_id, info.position)
        return info

    def _close_failed(self, run_id: str) -> SessionInfo:
        """Close a run that could not be restored: it stays on disk as it is (closed), and its
        slot is free."""
        spec, reason = self._failed_runs.pop(run_id)
        self.state_dir.run(run_id).write_spec(dataclasses.replace(spec, state=RUN_CLOSED))
        logger.info("run %s closed without being restored (%s)", run_id, reason)
        return SessionInfo(run_id=run_id, device=str(self.device), state=outcomes.CLOSED)

    def _closed_run_info(self, run_id: str) -> SessionInfo:
        recorded = self.state_dir.run(run_id).exists()
        # On a server of many runs a closed run is named apart from the others: closing it again
        # is a no-op whatever else is open.
        open_run = self.open_run_id if self.max_runs == 1 else None
        return self.lifecycle.closed_run_info(run_id, open_run, recorded, str(self.device))

    def discard_saved(
        self, run_id: str, *, checkpoints: Sequence[str] = (), exports: Sequence[str] = ()
    ) -> list[str]:
        """Remove checkpoints and exports of run ``run_id`` (open or closed), on the engine
        thread so no operation is reading them; returns the checkpoints kept for now (the open run's
        recovery point: see ``run_checkpoints.discard_saved``). Names are checked where the
        folders are resolved (``state_dir.confined``)."""

        def discard() -> list[str]:
            active = self._runs.get(run_id)
            is_open = active is not None
            run = active.run if active is not None else self.state_dir.run(run_id)
            return discard_saved(run, run_id, list(checkpoints), list(exports), is_open=is_open)

        return self._serialized(discard, refusable=False)

    def copy_saved(self, source_run: str, target: RunSpec, folder: str, name: str | None) -> None:
        """Copy run ``source_run``'s (open or closed) checkpoint (``folder`` "checkpoints") or
        export ("exports") ``name`` into a new run ``target``, recorded closed: it is never
        opened to train, and its checkpoint is read as any closed run's (loaded, sampled,
        downloaded). ``name`` None makes the run with none of the source's files (the Tinker
        front offers an encrypted export's own files instead). The files share the source's
        storage, and the run appears whole or not at all (``run_checkpoints.copy_into_run``);
        on the engine thread, as removals are, so nothing removes the source meanwhile. Copying
        again (a retry) finds it done."""
        check_name(target.run_id, "run id")

        def copy() -> None:
            source = self.state_dir.run(source_run)
            copy_into_run(source, self.state_dir.run(target.run_id), target, folder, name)

        self._serialized(copy, refusable=False)

    def discard_copy(self, run_id: str) -> None:
        """Remove run ``run_id``, a copy ``copy_saved`` made that nobody was answered with (its
        record could not be written), whole; on the engine thread, as removals are. An open run is
        refused (``run_checkpoints.discard_run``)."""
        check_name(run_id, "run id")

        def discard() -> None:
            if run_id in self._runs or run_id in self._failed_runs:
                raise FailedPrecondition(f"run {run_id!r} is open on this server")
            run = self.state_dir.run(run_id)
            if run.exists():  # its rows go first: a crash between leaves a run with no keys
                forget_run(self.ledger, run_id)
            discard_run(run)

        self._serialized(discard, refusable=False)

    def runs(self) -> list[SessionInfo]:
        """The open runs, by run id, each as ``info`` gives it (a run a restart could not
        restore as ``failed``)."""
        return [self.info(run_id) for run_id in sorted([*self._runs, *self._failed_runs])]

    def info(self, run_id: str = "") -> SessionInfo:
        """Where the session stands, at once: while operations are queued or running, as of the
        last one finished (``state_digest`` then only if already known, else "").

        With ``run_id``, that run's: the open one's as above, a closed one's state (``closed``),
        NOT_FOUND for a run this server never had."""
        if run_id in self._failed_runs:
            return SessionInfo(run_id=run_id, device=str(self.device), state=outcomes.FAILED)
        if run_id and run_id not in self._runs and run_id not in self._pending_run_ids:
            return self._recorded_info(run_id)
        if self.phase != outcomes.OPEN:
            return self._idle_info()
        active = self._runs.get(run_id) if run_id else self._only_run
        if active is None:
            raise FailedPrecondition(self._name_the_run())
        run_id = active.spec.run_id
        snapshot = self._snapshots.get(run_id)  # taken at open, at restore and after each operation
        if snapshot is not None and (self.scheduler.busy or self.scheduler.waiting):
            return snapshot  # never queued behind work: Info answers at once in every state
        return self._serialized(
            lambda: active.info() if run_id in self._runs else self._recorded_info(run_id),
            refusable=False,
            lane=self.lane_of(run_id),
        )

    def _recorded_info(self, run_id: str) -> SessionInfo:
        """A run that is not open: its state (``closed``) if this server had it, else
        NOT_FOUND."""
        check_name(run_id, "run id")
        if not self.state_dir.run(run_id).exists():
            raise NotFound(not_open(run_id))
        closed = self.lifecycle.closed_info
        if closed is not None and closed.run_id == run_id:
            return closed
        return SessionInfo(run_id=run_id, device=str(self.device), state=outcomes.CLOSED)

    def begin_shutdown(self) -> None:
        """Refuse new operations (UNAVAILABLE); the one in flight finishes and commits, and one
        held for its position is refused now."""
        self.lifecycle.begin_shutdown()
        self.scheduler.release_positions()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no operation runs; False if ``timeout_s`` passed first."""
        return self.scheduler.wait_idle(timeout_s)

    def release(self) -> None:
        """Close the journals and the ledger, and let go of the state directory (after
        ``wait_idle``; the Tinker front's intake stops first: its records are in the ledger)."""

        def release() -> None:
            for active in self._runs.values():
                active.journal.close()
            self.ledger.close()
            self.state_dir.release()

        self.scheduler.release(release)

    @property
    def _only_run(self) -> ActiveRun | None:
        """The open run when exactly one is (the server's only run), else None. A run that
        failed alone still holds its slot: beside it, "" names no run (a client of the failed
        run that never named it would land on the other)."""
        if len(self._runs) != 1 or self._failed_runs:
            return None
        return next(iter(self._runs.values()))

    @property
    def open_run_ids(self) -> list[str]:
        """Every open run's id (one a restart could not restore included), sorted, at no
        cost."""
        return sorted([*self._runs, *self._failed_runs])

    @property
    def open_run_id(self) -> str | None:
        """The only open run's id (None when no run, or several, are open), at no cost."""
        return None if self._only_run is None else self._only_run.spec.run_id

    @property
    def position(self) -> int:
        """The only open run's position (state-changing operations applied; 0 unless exactly
        one run is open), at no cost: ``info()`` would hash the whole state to give its digest
        too."""
        return 0 if self._only_run is None else self._only_run.position

    def was_closed(self, run_id: str) -> bool:
        """Whether run ``run_id`` was closed on this server (through any transport): neither
        open, nor still to be restored, nor holding its slot after a failed restore, and
        recorded closed. At no cost while the run is open; a transport that keeps its own
        table of runs (the Tinker front's models) asks this rather than being told."""
        if run_id in self._runs or run_id in self._failed_runs or run_id in self._pending_run_ids:
            return False
        run = self.state_dir.run(run_id)
        return run.exists() and run.read_spec().state == RUN_CLOSED

    def position_of(self, run_id: str) -> int:
        """Run ``run_id``'s position (0 when it is not open), at no cost."""
        active = self._runs.get(run_id)
        return 0 if active is None else active.position

    @property
    def journal(self) -> Journal | None:
        """The only open run's journal (None unless exactly one run is open); for inspection
        only: operations go through ``apply``."""
        return None if self._only_run is None else self._only_run.journal

    @property
    def session(self) -> TrainingSession | None:
        """The only open run's engine (None unless exactly one run is open); for inspection
        only: operations go through ``apply``, and nothing outside the host changes the
        engine."""
        return None if self._only_run is None else self._only_run.session

    def weights_version(self, run_id: str) -> int:
        """How many times the open run's live weights changed in this process (an update, a
        load: ``TrainingSession.weights_version``). Read at an export's turn, it is the version
        the export holds: a sample that names both (``SampleRequest.live_at``) reads the live
        weights while they are still that version."""
        return self._require_active(run_id).session.weights_version

    # -- operations ------------------------------------------------------------------------------

    def apply(
        self,
        operation: Operation[RequestT],
        request: RequestT,
        op: OperationSpec | None = None,
        *,
        run_id: str = "",
        account: str | None = "",
    ) -> Any:
        """Run ``operation`` (an entry of ``operations.OPERATIONS``) on ``request`` and wait for
        it: ``submit`` for a caller that waits on its own thread (a gRPC handler).

        The request is checked before anything is queued. A keyed operation needs ``op`` (its
        key and expected position) and takes ``keyed_path.apply_keyed``'s path; its caller hears
        of it once its journal entry is on disk. A read takes no ``op`` and runs on the
        engine thread behind everything queued before it, so it never sees weights mid-update.
        ``run_id`` names the run the call is for (NOT_FOUND when it is not the open one, checked
        when the call's turn comes); "" is the open run. ``account`` is whose handler thread
        waits for the call (a tenant; "" on a server without tenants): refused at once
        (RESOURCE_EXHAUSTED) when that account's calls are at the scheduler's bound, whatever
        other accounts wait; None for a request accepted already (a Tinker call at its turn),
        which is never refused for what others send.
        """
        self.check(operation, request)
        return self.apply_checked(operation, request, op, run_id=run_id, account=account)

    def check(self, operation: Operation[RequestT], request: RequestT) -> None:
        """Refuse ``request`` (InvalidArgument, naming what is wrong) before anything is queued:
        ``apply`` checks each request; the intake checks one when it accepts it."""
        if not isinstance(request, operation.request_type):
            raise TypeError(
                f"{operation.kind} takes a {operation.request_type.__name__}, "
                f"not a {type(request).__name__}"
            )
        operation.check(request, self.model_root)

    def apply_checked(
        self,
        operation: Operation[RequestT],
        request: RequestT,
        op: OperationSpec | None = None,
        *,
        body_digest: str | None = None,
        run_id: str = "",
        account: str | None = None,
    ) -> Any:
        """``apply`` for a request ``check``ed already (by default never refused for what
        waits: ``account`` None, see ``apply``). ``body_digest``: see ``Command.digest``."""
        if operation.keyed and op is None:
            raise TypeError(f"{operation.kind} changes the session: give its OperationSpec")
        if not operation.keyed and op is not None:
            raise TypeError(f"{operation.kind} is a read: it takes no operation key")
        command = Command(
            operation,
            request,
            run_id,
            op,
            digest=body_digest,
            account=account,
        )
        self.lifecycle.refuse_if_unavailable()
        # Admitted before its position: a call held for its predecessor holds a server thread
        # as much as one ready to run, so both count against the one bound.
        with self.scheduler.admitted(account):
            applied: Applied = self.submit(command).result()
        try:
            wait_durable(applied.commit, operation.kind if op is None else op.key)
        except JournalCommitFailed as error:
            raise self.journal_failed(error) from None
        return applied.outcome

    def submit(self, command: Command) -> Ticket:
        """Queue ``command`` (``CommandQueue.submit``): the one way both transports reach the
        engine; its ticket."""
        return self.commands.submit(command)

    # -- the scheduler -----------------------------------------------------------------------------

    def _serialized(
        self,
        call: Callable[..., T],
        *args: Any,
        refusable: bool = True,
        lane: str = "",
        account: str | None = "",
    ) -> T:
        """``call(*args)`` on the engine thread, after everything queued before it.

        A ``refusable`` call (an operation, a read) counts against ``account``'s bound of
        waiting calls (``Scheduler.admitted``) and is UNAVAILABLE while the server restores or
        shuts down; Info, Close and the restore itself always run.
        """
        if not refusable:
            return self.scheduler.run(lambda: call(*args), lane=lane)
        with self.scheduler.admitted(account):
            self.lifecycle.refuse_if_unavailable()
            refusing = partial(refusing_if_unavailable, self.lifecycle, partial(call, *args))
            return self.scheduler.run(refusing, lane=lane)

    def journal_failed(self, error: JournalCommitFailed) -> FailedPrecondition:
        """The engine moved on but the journal did not: the server fails (only a restart makes
        them agree); what the operation's caller is answered."""
        self._fail(str(error))
        return FailedPrecondition(f"{self.lifecycle.failure}; restart the server")

    # -- helpers ---------------------------------------------------------------------------------

    def prepare_sample(self, run_id: str, request: Any) -> PreparedSample:
        """A sample at its turn (``CommandQueue.prepare_sample``)."""
        return self.commands.prepare_sample(run_id, request)

    def _start_positions(self, run_id: str) -> None:
        """Requests that name a position of ``run_id`` are ordered by it from now on."""

        def position() -> int:
            active = self._runs.get(run_id)
            return 0 if active is None else active.position

        self.scheduler.start_positions(
            run_id, position, idle_release_s=self.idle_release_s, lane=self.lane_of(run_id)
        )

    def lane_of(self, run_id: str) -> str:
        """The scheduler lane of ``run_id``'s calls: its own on a server of many runs (they take
        turns), the one lane otherwise (first in, first out, whatever the call)."""
        return run_id if self.max_runs > 1 else ""

    def _new_session(self, config: TrainingConfig, max_steps: int | None) -> TrainingSession:
        options: dict[str, Any] = {}
        if self.max_runs > 1 and config.lora is not None:
            # The base is the open runs': with none open (the last closed, or the run that
            # would have been the first was refused) the new run's base is loaded.
            if self._shared_base is None or not self._runs:
                self._shared_base = SharedBase(
                    config, device=self.device, model_root=self.model_root
                )
            options["base"] = self._shared_base
        session = self._session_factory(
            config, device=self.device, max_steps=max_steps, model_root=self.model_root, **options
        )
        session.sampler.batches = self.sample_batching
        return session

    def _require_active(self, run_id: str = "") -> ActiveRun:
        """The open run ``run_id`` (NOT_FOUND unless it is open: a client bound to a run that
        closed never reaches another); "" is the server's only open run."""
        if run_id in self._failed_runs:
            raise FailedPrecondition(
                f"{self._failed_runs[run_id][1]}; the other runs serve. Close it to free its "
                "slot (its files stay as they are)"
            )
        self.lifecycle.require(outcomes.OPEN)
        if run_id:
            active = self._runs.get(run_id)
            if active is None:
                raise NotFound(not_open(run_id))
            return active
        active = self._only_run
        if active is None:
            raise FailedPrecondition(self._name_the_run())
        return active

    def _name_the_run(self) -> str:
        return (
            f"{len(self.open_run_ids)} runs are open on this server: name the run (run_id; "
            "SessionClient binds the run it opened, ListRuns lists them)"
        )

    @property
    def _pending_run_ids(self) -> set[str]:
        return {spec.run_id for spec in self._pending}

    def _idle_info(self) -> SessionInfo:
        run_id = self._pending[0].run_id if len(self._pending) == 1 else ""
        return self.lifecycle.idle_info(run_id, str(self.device))

    def _fail(self, message: str) -> None:
        self.lifecycle.fail(message)

    def _run_broke(self, active: ActiveRun, message: str) -> None:
        """``active``'s session broke midway (an operation half applied): only a restart,
        which restores its latest checkpoint, makes it trustworthy again. Where other runs are
        open they go on serving (one tenant's run never stops another's accepted calls): this
        run fails alone, its calls answered with ``message`` and its slot held until it is
        closed or the server restarts (its files say it is open: a restart restores it). The
        server's only open run fails the server instead (health NOT_SERVING: a supervisor
        restarts it, and nothing else is interrupted)."""
        run_id = active.spec.run_id
        if self._runs.get(run_id) is not active:  # failed already (or closed meanwhile)
            return
        if set(self._runs) == {run_id}:
            self._fail(message)
            return
        logger.error("run %s failed alone (the other runs serve): %s", run_id, message)
        del self._runs[run_id]
        self._snapshots.pop(run_id, None)
        self._failed_runs[run_id] = (active.spec, message)
        self.scheduler.end_stream(run_id)  # its held calls fail at their turn, as it is failed
        active.journal.close()  # what it applied before is durable, as at a close

    def _open_run_or_none(self, run_id: str) -> ActiveRun | None:
        return self._runs.get(run_id) if run_id else self._only_run

    def _applied(self, active: ActiveRun) -> None:
        """A keyed operation applied to ``active``: its snapshot (``info`` while it is busy)."""
        self._snapshots[active.spec.run_id] = active.info(digest_known_only=True)


def not_open(run_id: str) -> str:
    """Why a call for ``run_id`` is refused: that run is not open here."""
    return (
        f"run {run_id!r} is not open on this server (it was closed, or never opened here); "
        "open a run to go on"
    )
