"""The replay's operations on a remote session: keyed, numbered and pipelined.

``KeyedSession`` gives every operation its stable key,
``{run_id}/{manifest fingerprint}/{microbatch}/{operation}``, and the position it will land at
(numbered by one ``OperationPipeline``); ``RemoteBackend`` is the replay's backend over it, with
a window of operations in flight. The controller (``controller``) decides where to resume and
what to do after the last microbatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from trainwire.client.control.cursor import Record, WorkDirectory
from trainwire.client.session.pipeline import OperationPipeline
from trainwire.client.session.retry import position_from_error
from trainwire.contract.config import InputExample
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.run.replay import RunState, StepOutcome, checkpoint_due
from trainwire.contract.run.selection import BEST_CHECKPOINT

logger = logging.getLogger(__name__)

LATEST_CHECKPOINT = "latest"
# The operation part of a key (see operation_key); tuples of (microbatch, operation) sort in the
# plan's order because "forward_backward" < "optim_step".
FORWARD_BACKWARD, OPTIM_STEP = "forward_backward", "optim_step"


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


class RemoteBackend:
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
