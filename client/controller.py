"""The controller: replays a manifest against a remote session, exactly once, through crashes.

Every operation carries a stable key, ``{run_id}/{manifest fingerprint}/{microbatch}/{operation}``,
and the position the controller believes the session is at. The server's journal answers a key
it has seen with the recorded result, so replaying after any crash re-applies nothing; the
position check makes sure no operation lands on a state the controller did not expect. The
cursor is persisted only after the operations it covers have committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from trainwire.client.artifacts import write_run_artifacts
from trainwire.client.config import InputExample
from trainwire.client.cursor import Record, WorkDirectory
from trainwire.client.pipeline import DEFAULT_WINDOW, OperationPipeline
from trainwire.client.plan import ManagedTrainingPlan
from trainwire.client.progress import Progress
from trainwire.client.replay import (
    RunState,
    StepOutcome,
    checkpoint_due,
    replay,
    training_result,
)
from trainwire.client.results import TrainingResult
from trainwire.client.retry import RETRYABLE_CODES, RetryPolicy, position_from_error
from trainwire.client.selection import BEST_CHECKPOINT

logger = logging.getLogger(__name__)

LATEST_CHECKPOINT = "latest"
EXPORT_NAME = "final"
EXPORT_DIR = "export"
# The operation part of a key (see operation_key); tuples of (microbatch, operation) sort in the
# plan's order because "forward_backward" < "optim_step".
FORWARD_BACKWARD, OPTIM_STEP = "forward_backward", "optim_step"
# The waits between tries to reach a lost server (a restart, a lost connection); how long to keep
# trying is the controller's recovery_timeout_s, so the policy's max_attempts plays no part.
OUTAGE_BACKOFF = RetryPolicy()
DEFAULT_RECOVERY_TIMEOUT_S = 3600.0


class PositionMoved(Exception):
    """The server is not where the controller expected (it restarted): resynchronize."""


def operation_key(run_id: str, fingerprint: str, index: int, operation: str) -> str:
    return f"{run_id}/{fingerprint}/{index}/{operation}"


def microbatch_of_key(key: str, run_id: str, fingerprint: str) -> int | None:
    """The microbatch index a key of this run names, or None for another run's key."""
    prefix = f"{run_id}/{fingerprint}/"
    if not key.startswith(prefix):
        return None
    index, _, _ = key[len(prefix) :].partition("/")
    return int(index) if index.isdigit() else None


class KeyedSession:
    """The run's state-changing calls on the client, each keyed and position-checked.

    ``position`` is where the session stands after the last outcome taken. The calls are issued
    through one ``OperationPipeline`` (bound: the controller's window), which numbers them in
    issue order from the position ``reset`` gave, the controller's own record, never the
    server's. A server that is elsewhere (a restart restored an older checkpoint) refuses a call
    before running anything, raised as ``PositionMoved``.
    """

    def __init__(self, client: Any, *, run_id: str, fingerprint: str, window: int = 1) -> None:
        self.client = client
        self.run_id = run_id
        self.fingerprint = fingerprint
        self.position = 0
        self.pipeline = OperationPipeline(window)

    def __enter__(self) -> KeyedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pipeline.close()

    def reset(self, position: int) -> None:
        """Resume at ``position``; nothing may be in flight."""
        self.position = position
        self.pipeline.start_at(position)

    def call(
        self, method: Callable[..., Any], index: int, operation: str, *args: Any, **kwargs: Any
    ) -> Any:
        """``method(*args, **kwargs)`` under the key of ``operation`` at microbatch ``index``,
        numbered next, and its outcome."""
        return self.take(self.submit(method, index, operation, *args, **kwargs))

    def submit(
        self, method: Callable[..., Any], index: int, operation: str, *args: Any, **kwargs: Any
    ) -> futures.Future[Any]:
        """Issue the blocking call ``method`` at the next position (waiting for a free slot);
        ``take`` its outcome."""
        return self.pipeline.submit(self._keyed(method, index, operation, *args, **kwargs))

    def submit_ahead(
        self, method: Callable[..., Any], index: int, operation: str, *args: Any, **kwargs: Any
    ) -> futures.Future[Any] | None:
        """``submit`` if that needs no wait, else None (nothing issued): no free slot, or a call
        failed since ``reset``, and nothing issued after it would apply."""
        return self.pipeline.try_submit(self._keyed(method, index, operation, *args, **kwargs))

    def _keyed(
        self, method: Callable[..., Any], index: int, operation: str, *args: Any, **kwargs: Any
    ) -> Callable[[int], Any]:
        key = operation_key(self.run_id, self.fingerprint, index, operation)

        def call(position: int) -> Any:
            return method(*args, operation_key=key, expected_position=position, **kwargs)

        return call

    def take(self, future: futures.Future[Any]) -> Any:
        """The outcome of a call issued by ``submit``, in issue order."""
        try:
            outcome = future.result()
        except grpc.RpcError as error:
            if position_from_error(error) is not None:
                raise PositionMoved(error.details()) from error
            raise
        self.position = outcome.position
        return outcome


class _RemoteBackend:
    """The replay's operations (``ReplayBackend``) as keyed calls on the remote session.

    The microbatches ahead are issued before the replay asks for them, while the session's
    pipeline has a free slot (its bound is the window), and never past a microbatch after which
    the replay evaluates or checkpoints: those need every operation before them applied and
    nothing after. The replay still takes each outcome in plan order, so its decisions, cursor
    and history are a window of 1's.
    """

    def __init__(
        self, session: KeyedSession, plan: ManagedTrainingPlan, work: WorkDirectory, every: int
    ) -> None:
        self.session = session
        self.client = session.client
        self.plan = plan
        self.work = work
        self.checkpoint_every = every
        self._issued: dict[tuple[int, str], futures.Future[Any]] = {}  # not yet taken
        self._next_op = (0, FORWARD_BACKWARD)  # the next operation to issue, in plan order
        self._barrier: int | None = None  # issue nothing past this microbatch for now

    def forward_backward(self, index: int, examples: list[InputExample]) -> tuple[float, int]:
        outcome = self._outcome(index, FORWARD_BACKWARD)
        return outcome.loss, outcome.token_count

    def optim_step(self, index: int) -> StepOutcome:
        outcome = self._outcome(index, OPTIM_STEP)
        return StepOutcome(outcome.step, outcome.learning_rate, outcome.grad_norm)

    def _outcome(self, index: int, operation: str) -> Any:
        if self._next_op < (index, operation):
            self._next_op = (index, operation)  # the replay resumed further on
        if self._barrier is not None and index > self._barrier:
            self._barrier = None  # the replay is past the evaluation or checkpoint
        self._issue_ahead(wait=(index, operation) not in self._issued)
        return self.session.take(self._issued.pop((index, operation)))

    def _issue_ahead(self, *, wait: bool) -> None:
        """Issue operations in plan order: the first waiting for a slot if ``wait`` (the replay
        needs it now), the rest only while that needs no wait."""
        plan = self.plan
        while self._next_op[0] < plan.batch_count:
            index, operation = self._next_op
            if self._barrier is not None and index > self._barrier:
                return  # nothing after an evaluation or checkpoint before it has happened
            future = self._submit(index, operation, wait=wait)
            if future is None:
                return  # no free slot for now, or a failure that the replay will meet
            self._issued[self._next_op], wait = future, False
            if operation == FORWARD_BACKWARD and plan.is_update(index):
                self._next_op = (index, OPTIM_STEP)
                continue
            self._next_op = (index + 1, FORWARD_BACKWARD)
            if plan.evaluates_after(index) or checkpoint_due(plan, index, self.checkpoint_every):
                self._barrier = index

    def _submit(self, index: int, operation: str, *, wait: bool) -> futures.Future[Any] | None:
        submit = self.session.submit if wait else self.session.submit_ahead
        if operation == FORWARD_BACKWARD:
            return submit(self.client.forward_backward, index, operation, self.plan.batch(index))
        return submit(self.client.optim_step, index, operation)

    def abandon(self) -> None:
        """Wait for whatever is still in flight (after a failure): nothing lands later."""
        self.session.pipeline.drain()
        self._issued.clear()

    def forward(self, examples: list[InputExample]) -> tuple[float, list[str]]:
        outcome = self.client.forward(examples)
        # Forward carries no position: make sure it ran on the state we expect, not on an older
        # checkpoint a restarted server restored in between.
        info = self.client.info()
        if info.position != self.session.position:
            raise PositionMoved(
                f"evaluation met position {info.position}, expected {self.session.position}"
            )
        return outcome.loss, [prediction.label for prediction in outcome.predictions]

    def save_best(self, index: int, state: RunState) -> None:
        state.best_checkpoint = BEST_CHECKPOINT
        self._checkpoint(index, "save_best", BEST_CHECKPOINT, state)

    def after_microbatch(self, index: int, state: RunState) -> None:
        plan, every = self.plan, self.checkpoint_every
        if checkpoint_due(plan, index, every):
            self._checkpoint(index, "checkpoint", LATEST_CHECKPOINT, state)
        self.work.write_cursor(Record(self.session.position, state))

    def _checkpoint(self, index: int, operation: str, name: str, state: RunState) -> None:
        # The snapshot goes first: once the checkpoint exists, a server restarting from it must
        # find the controller's state for its position.
        self.work.write_snapshot(Record(self.session.position + 1, state))
        self.session.call(self.client.save_state, index, operation, name)


class Controller:
    """Drives one run of ``manifest`` on the session behind ``client``.

    Args:
        client: a ``SessionClient`` (or anything with its methods).
        manifest: the manifest dict (its fingerprint is verified) or a ``ManagedTrainingPlan``.
        run_id: names the run on the server and in every operation key.
        work_dir: the cursor, snapshots, downloaded export and summary live here.
        checkpoint_every: ask the server for a checkpoint every this many updates.
        recovery_timeout_s: how long to keep waiting for an unreachable server: an hour, longer
            than Kubernetes takes to restart a failed pod with the shipped probes (deploy/).
        window: operations kept in flight (pipelined); any window ends with window 1's bits.
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
    ) -> None:
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id must be non-empty and free of '/', got {run_id!r}")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be positive, got {checkpoint_every}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
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

    # -- the run -------------------------------------------------------------------------------

    def _synchronize(self, session: KeyedSession) -> None:
        """Open the session (idempotent) and decide where to resume from the server's position."""
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
        logger.info(
            "run %s: resuming at microbatch %d, position %d (server at %d)",
            self.run_id,
            self.state.next_microbatch,
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
        """Replay to the end, export the result, write the summary; resumable at any point."""
        fingerprint = self.plan.fingerprint
        with KeyedSession(
            self.client, run_id=self.run_id, fingerprint=fingerprint, window=self.window
        ) as session:
            return self._run(session, on_step)

    def _run(
        self, session: KeyedSession, on_step: Callable[[Progress], None] | None
    ) -> TrainingResult:
        """``run``: resynchronize after a moved position, wait out an outage."""
        outage_started: float | None = None
        attempt = 0
        while True:
            try:
                self._synchronize(session)
                # Reachable again: a later outage gets the whole recovery budget of its own.
                outage_started, attempt = None, 0
                backend = _RemoteBackend(session, self.plan, self.work, self.checkpoint_every)
                try:
                    self.state = replay(self.plan, backend, self.state, on_step=on_step)
                finally:
                    backend.abandon()
                return self._finish(session)
            except PositionMoved as moved:
                logger.warning("run %s: %s; resynchronizing", self.run_id, moved)
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE_CODES:
                    raise
                now = time.monotonic()
                outage_started = outage_started or now
                if now - outage_started > self.recovery_timeout_s:
                    raise
                delay = OUTAGE_BACKOFF.delay_s(attempt)
                attempt += 1
                logger.warning(
                    "run %s: server unreachable (%s); retrying in %.1fs",
                    self.run_id,
                    error.code().name,
                    delay,
                )
                time.sleep(delay)

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
        write_run_artifacts(
            self.work.path,
            result,
            self.plan,
            run_id=self.run_id,
            export_dir=str(export_dir),
            exported_from=checkpoint or "live",
        )
        return result
