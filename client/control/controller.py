"""The controller: replays a manifest against a remote session, exactly once, through crashes.

Every operation carries a stable key, ``{run_id}/{manifest fingerprint}/{microbatch}/{operation}``,
and the position the controller believes the session is at. The server's journal answers a key
it has seen with the recorded result, so replaying after any crash re-applies nothing; the
position check makes sure no operation lands on a state the controller did not expect. The
cursor is persisted only after the operations it covers have committed. A run that finished (its
export downloaded, its summary written) is closed on the server, so a restart of the server rolls
nothing of it back and the next run opens; resuming it again only makes sure it is closed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from trainwire.client.control.cursor import WorkDirectory
from trainwire.client.control.remote_replay import (
    KeyedSession,
    PositionMoved,
    RemoteBackend,
    microbatch_of_key,
)
from trainwire.client.session.errors import ServerUnreachable
from trainwire.client.session.pipeline import DEFAULT_WINDOW
from trainwire.client.session.retry import RETRYABLE_CODES, RetryPolicy
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.report.artifacts import SUMMARY_JSON, write_run_artifacts
from trainwire.contract.report.progress_text import duration_text
from trainwire.contract.report.tensorboard_log import (
    TENSORBOARD_DIR,
    TensorBoardLog,
    require_tensorboard,
)
from trainwire.contract.run.progress import Progress
from trainwire.contract.run.replay import (
    RunState,
    checkpoint_due,
    replay,
    training_result,
)
from trainwire.contract.run.results import TrainingResult
from trainwire.contract.run.selection import BEST_CHECKPOINT

logger = logging.getLogger(__name__)

EXPORT_NAME = "final"
EXPORT_DIR = "export"
# The waits between tries to reach a lost server (a restart, a lost connection); how long to keep
# trying is the controller's recovery_timeout_s, so the policy's max_attempts plays no part.
OUTAGE_BACKOFF = RetryPolicy()
DEFAULT_RECOVERY_TIMEOUT_S = 3600.0


class Controller:
    """Drives one run of ``manifest`` on the session behind ``client``.

    Args:
        client: a ``SessionClient`` (or anything with its methods).
        manifest: the manifest dict (its fingerprint is verified) or a ``ManagedTrainingPlan``.
        run_id: names the run on the server and in every operation key.
        work_dir: the cursor, snapshots, downloaded export and summary live here.
        checkpoint_every: ask the server for a checkpoint every this many updates.
        recovery_timeout_s: how long to keep waiting for a server that went away: an hour,
            longer than Kubernetes takes to restart a failed pod with the shipped probes
            (deploy/). Only a server this run reached before (in this process, or as the work
            directory records) is waited for; one never reached fails at once
            (``ServerUnreachable``), since an address nobody serves is a mistake, not an outage.
        window: operations kept in flight (pipelined); any window ends with window 1's bits.
        tensorboard: also write the history as TensorBoard event files, in the work directory's
            ``tensorboard/`` as each microbatch is done (needs the ``tensorboard`` extra).
    """

    def __init__(
        self,
        client: Any,
        manifest: dict[str, Any] | ManagedTrainingPlan,
        *,
        run_id: str,
        work_dir: str | Path,
        checkpoint_every: int = 10,
        recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S,
        window: int = DEFAULT_WINDOW,
        tensorboard: bool = False,
    ) -> None:
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id must be non-empty and free of '/', got {run_id!r}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be positive, got {checkpoint_every}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        if tensorboard:
            require_tensorboard()
        if isinstance(manifest, ManagedTrainingPlan):
            self.plan = manifest
        else:
            self.plan = ManagedTrainingPlan.from_manifest(manifest)
        self.client = client
        self.run_id = run_id
        self.checkpoint_every = checkpoint_every
        self.recovery_timeout_s = recovery_timeout_s
        self.window = window
        self.work = WorkDirectory(
            work_dir, run_id=run_id, manifest_fingerprint=self.plan.fingerprint
        )
        self.work.bind()
        self.state = RunState.start(self.plan)
        self._resumed: dict[str, float] | None = None  # where and when the run last started
        self.tensorboard = tensorboard
        self._board: TensorBoardLog | None = None  # open while the run runs, with tensorboard

    # -- the run -------------------------------------------------------------------------------

    def _synchronize(self, session: KeyedSession, outage_started: float | None = None) -> None:
        """Open the session (idempotent) and decide where to resume from the server's position;
        ``outage_started``: when the server became unreachable, if it did."""
        info = self.client.open(
            self.run_id,
            self.plan.config,
            max_steps=self.plan.max_steps,
            plan_fingerprint=self.plan.fingerprint,
        )
        record = self.work.resume_point(info.position, RunState.start(self.plan))
        if record.position < info.position:
            # The operations past the record must belong to the microbatches it resumes at,
            # which a window issues up to the next evaluation or checkpoint (or, for a finished
            # run, to the closing export), so replaying their keys is exact.
            last = microbatch_of_key(info.last_operation_key, self.run_id, self.plan.fingerprint)
            state = record.state
            limit = self.plan.batch_count if state.finished else self._flush_point(state)
            if last is None or last > limit:
                raise RuntimeError(
                    f"the server's session is at position {info.position} (last operation "
                    f"{info.last_operation_key!r}), beyond anything recorded in {self.work.path}; "
                    "resume with the work directory that started this run"
                )
        session.reset(record.position)
        self.state = record.state
        # The progress view measures its rate from here: an outage is not slow training.
        self._resumed = {"microbatch": self.state.next_microbatch, "at_s": time.monotonic()}
        back = (
            ""
            if outage_started is None
            else f"server back after {duration_text(time.monotonic() - outage_started)}; "
        )
        fresh = self.state.next_microbatch == 0 and info.position == 0 and not back
        # A fresh start needs no words (the progress view shows it); a resume says where.
        logger.log(
            logging.DEBUG if fresh else logging.INFO,
            "run %s: %s%s at microbatch %d of %d (position %d, server at %d)",
            self.run_id,
            back,
            "starting" if fresh else "resuming",
            self.state.next_microbatch,
            self.plan.batch_count,
            session.position,
            info.position,
        )

    def _flush_point(self, state: RunState) -> int:
        """The last microbatch a window may have issued from ``state`` on: the first after
        which the replay evaluates or checkpoints (nothing is issued past it before that)."""
        plan, index = self.plan, state.next_microbatch
        while index + 1 < plan.batch_count and not (
            plan.evaluates_after(index) or checkpoint_due(plan, index, self.checkpoint_every)
        ):
            index += 1
        return index

    def run(self, on_step: Callable[[Progress], None] | None = None) -> TrainingResult:
        """Replay to the end, export the result, write the summary, close the run on the server;
        resumable at any point (a run that finished only makes sure its session is closed)."""
        finished = self._finished_result()
        if finished is not None:
            with self._tensorboard_log():
                self._follow_history(finished.history)  # a flag given only now writes it all
            self.client.close(run_id=self.run_id)  # a no-op if it closed before
            return finished
        fingerprint = self.plan.fingerprint
        with (
            KeyedSession(
                self.client, run_id=self.run_id, fingerprint=fingerprint, window=self.window
            ) as session,
            self._tensorboard_log(),
        ):
            return self._run(session, on_step)

    @contextlib.contextmanager
    def _tensorboard_log(self) -> Iterator[None]:
        """The event files' writer, open for the block when the run writes them."""
        if not self.tensorboard:
            yield
            return
        with TensorBoardLog(self.work.path / TENSORBOARD_DIR) as board:
            self._board = board
            try:
                yield
            finally:
                self._board = None

    def _follow_history(self, history: list[dict[str, Any]]) -> None:
        if self._board is not None:
            self._board.follow(history)

    def _run(
        self, session: KeyedSession, on_step: Callable[[Progress], None] | None
    ) -> TrainingResult:
        """``run``: resynchronize after a moved position, wait out an outage."""
        outage_started: float | None = None
        attempt = 0
        report = self._reporting(on_step)
        while True:
            try:
                self._synchronize(session, outage_started)
                # Reachable again: a later outage gets the whole recovery budget of its own.
                outage_started, attempt = None, 0
                backend = RemoteBackend(session, self.plan, self.work, self.checkpoint_every)
                try:
                    self.state = replay(self.plan, backend, self.state, on_step=report)
                finally:
                    backend.abandon()
                return self._finish(session)
            except PositionMoved as moved:
                logger.warning("run %s: %s; resynchronizing", self.run_id, moved)
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE_CODES or not self._met_server(error):
                    raise
                outage_started = self._outage(error, outage_started)
                delay = OUTAGE_BACKOFF.delay_s(attempt)
                attempt += 1
                logger.debug(
                    "run %s: %s (%s); try %d again in %.1fs",
                    self.run_id,
                    error.code().name,
                    error.details(),
                    attempt,
                    delay,
                )
                time.sleep(delay)

    def _met_server(self, error: grpc.RpcError) -> bool:
        """Whether the server behind ``error`` is one this run met: the client reached it, or
        this work directory records the run's progress on it (a restarted controller whose
        server is restarting too waits for it, as the one before would have)."""
        return not isinstance(error, ServerUnreachable) or bool(self.work.records())

    def _outage(self, error: grpc.RpcError, started: float | None) -> float:
        """When the outage ``error`` belongs to started; raises ``error`` past the recovery
        budget. One warning per outage (and one line when the server is back, from
        ``_synchronize``): the tries between are detail, at debug level."""
        now = time.monotonic()
        if started is None:
            logger.warning(
                "run %s: server unreachable (%s); waiting up to %s for it",
                self.run_id,
                error.code().name,
                duration_text(self.recovery_timeout_s),
            )
            return now
        if now - started > self.recovery_timeout_s:
            raise error
        return started

    def _reporting(
        self, on_step: Callable[[Progress], None] | None
    ) -> Callable[[Progress], None] | None:
        """What the replay calls after each microbatch: the history goes to the event files
        (their first call after a start writes what the restored history holds and they do not),
        then ``on_step`` hears it, told (``progress.extra["resumed"]``) where and when the run
        last (re)started with the first microbatch after each start."""
        if on_step is None and not self.tensorboard:
            return None

        def report(progress: Progress) -> None:
            self._follow_history(self.state.history)
            if on_step is None:
                return
            if self._resumed is not None:
                progress.extra["resumed"] = self._resumed
                self._resumed = None
            on_step(progress)

        return report

    def _finish(self, session: KeyedSession) -> TrainingResult:
        index = self.plan.batch_count  # past the last microbatch: the run's closing operations
        checkpoint = BEST_CHECKPOINT if self.state.best_checkpoint else None
        export_dir = self.work.path / EXPORT_DIR
        # The export's journaled digest is the final state's, even when this call is a replay
        # (a separate Info could meet a server that restarted and restored an older state).
        outcome = session.call(
            self.client.export_weights,
            index,
            "export",
            EXPORT_NAME,
            download_to=export_dir,
            replace=True,  # a resumed run downloads its own export again
            checkpoint=checkpoint,
            include_digest=True,
        )
        result = training_result(
            self.plan, self.state, state_digest=outcome.state_digest, last_checkpoint_path=None
        )
        # A run resumed past its last microbatch replays none, so nothing wrote its history yet.
        self._follow_history(result.history)
        write_run_artifacts(
            self.work.path,
            result,
            self.plan,
            run_id=self.run_id,
            export_dir=str(export_dir),
            exported_from=checkpoint or "live",
        )
        # Only after the summary: a finished run is closed, so nothing of it is rolled back by a
        # restart of the server, and the server takes the next run.
        self.client.close(run_id=self.run_id)
        return result

    def _finished_result(self) -> TrainingResult | None:
        """The result this work directory's summary records for this run and manifest: the
        run finished (its export downloaded, its summary written) and is not replayed again."""
        path = self.work.path / SUMMARY_JSON
        if not path.is_file():
            return None
        summary = json.loads(path.read_text())
        if (summary.get("run_id"), summary.get("manifest_fingerprint")) != (
            self.run_id,
            self.plan.fingerprint,
        ):
            return None
        return TrainingResult(**summary["result"])
