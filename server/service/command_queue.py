"""How a ``Command`` becomes the scheduler's job: the one way both transports reach the engine.

``CommandQueue.submit`` takes a command (``commands``) and queues the job that runs it, handing
back its ticket. Where the job waits is the command's: at its number in its transport's stream
(a Tinker model's ``seq_id``: accepted already, bound to its run at its turn), at the position its
caller expects its run at (gRPC's ``expected_position``), or now. A keyed job takes
``keyed_path``'s phases (journal lookup, position check, the engine, the commit) in one place for
both transports, and so does its part in a pass it may share with other runs' jobs
(``Job.shared``: ``shared_passes``): a LoRA run's forward_backward, and a forward read. What a
failure means for the server (a session broken midway, a journal that could not commit) is the
host's: the queue tells it (``RunAccess``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import FailedPrecondition
from trainwire.server.service import keyed_path
from trainwire.server.service.active_run import ActiveRun, Durable, JournalCommitFailed
from trainwire.server.service.commands import Applied, Command, Ticket, chained, settle
from trainwire.server.service.journal import (
    KeyDigest,
    check_operation_key,
    payload_digest,
    request_digest,
)
from trainwire.server.service.lifecycle import Lifecycle
from trainwire.server.service.operations import SAMPLE
from trainwire.server.service.sample_batching import PreparedSample
from trainwire.server.service.scheduler import Scheduler
from trainwire.server.service.scheduler_jobs import Shared

T = TypeVar("T")


@dataclass(frozen=True)
class RunAccess:
    """What the queue asks of the host's open runs, and tells it."""

    require: Callable[[str], ActiveRun]  # the open run ("" the only one), else NotFound & co.
    find: Callable[[str], ActiveRun | None]  # the open run, or None
    lane_of: Callable[[str], str]  # the scheduler lane of a run's jobs
    applied: Callable[[ActiveRun], None]  # a keyed operation applied to the run
    broke: Callable[[ActiveRun, str], None]  # a run's session broke midway: it fails
    journal_failed: Callable[[JournalCommitFailed], FailedPrecondition]  # the server fails


def refusing_if_unavailable(lifecycle: Lifecycle, call: Callable[[], T]) -> T:
    """``call()``, refused while the server restores or shuts down: checked again when a job's
    turn comes, so the callers queued behind the last one are refused."""
    lifecycle.refuse_if_unavailable()
    return call()


class CommandQueue:
    """Queues commands on ``scheduler`` as jobs of the runs ``runs`` gives (see the module
    docstring); ``lifecycle`` says when none may run."""

    def __init__(self, scheduler: Scheduler, lifecycle: Lifecycle, runs: RunAccess) -> None:
        self.scheduler = scheduler
        self.lifecycle = lifecycle
        self.runs = runs

    def submit(self, command: Command) -> Ticket:
        """Queue ``command``: the one way both transports reach the engine. Its ticket resolves
        on the engine thread with what it ``Applied`` (a keyed operation's commit is then still
        under way: its answer waits for it, the engine does not), or None when it did not run
        (``Command.runs_now``), or with its error.

        A command numbered in a stream (``Command.stream``) was accepted by its transport
        already: it is bound to its run, and checked against the lifecycle, at its turn. Any
        other is refused now (UNAVAILABLE while the server restores or shuts down, NOT_FOUND for
        a run not open) and checked again at its turn."""
        operation = command.operation
        if operation.keyed:
            return self._in_position(command, self._key_digest(command))
        if command.stream is not None:  # a read in its stream's order (a Tinker forward)
            shared = self._read_pass(command, command.run_id)
            if shared is not None:  # its outcome as ``_numbered_read`` gives it
                end = shared.end
                shared = dataclasses.replace(
                    shared, end=lambda result: Applied(_observed(command, end(result)))
                )
            return self._numbered(command, command.digest or "", self._numbered_read, shared)
        self.lifecycle.refuse_if_unavailable()
        run_id = self.runs.require(command.run_id).spec.run_id  # bound to it from here on
        lane = self.runs.lane_of(run_id)
        if operation is SAMPLE:  # decoded beside its run's samples queued with it
            prepare = partial(self.prepare_sample, run_id, command.request)
            return chained(self.scheduler.queue(prepare=prepare, lane=lane), Applied)
        read = partial(
            refusing_if_unavailable, self.lifecycle, partial(self._read, command, run_id)
        )
        shared = self._read_pass(command, run_id)
        return chained(self.scheduler.queue(read, lane=lane, shared=shared), Applied)

    def prepare_sample(self, run_id: str, request: Any) -> PreparedSample:
        """A sample at its turn: refused while the server restores or shuts down, else bound
        to its run (``run_id`` is fixed when the sample is accepted)."""
        self.lifecycle.refuse_if_unavailable()
        return PreparedSample.of(self.runs.require(run_id), request)

    def _read(self, command: Command, run_id: str) -> Any:
        return command.operation.apply(self.runs.require(run_id), command.request, None)

    def _key_digest(self, command: Command) -> KeyDigest:
        """What the journal binds the command's key to: its transport's digest of the body it
        received, else the payload's, taken before anything is queued."""
        if command.op is None:
            raise TypeError(f"{command.operation.kind} changes the session: give its key")
        check_operation_key(command.op.key)
        if command.digest is not None:
            return KeyDigest(request_digest(command.digest))
        payload = command.operation.payload
        assert payload is not None
        return KeyDigest(payload_digest(command.operation.kind, payload(command.request)))

    def _in_position(self, command: Command, digest: KeyDigest) -> Ticket:
        """The one keyed job of both transports, queued where its turn comes: at its number in
        its transport's stream, at its expected position of its run, else now (held positions
        of the run waiting while it is queued or runs); its ticket. Its ``Shared`` part
        (``_keyed_pass``) lets it run in one pass with other runs' calls instead."""
        if command.stream is not None:  # accepted already: bound to its run at its turn
            keyed = partial(self._numbered_keyed, digest=digest)
            shared = self._keyed_pass(command, digest, command.run_id)
            return self._numbered(command, command.digest or digest.value, keyed, shared)
        self.lifecycle.refuse_if_unavailable()
        stream = run_id = self.runs.require(command.run_id).spec.run_id
        apply = partial(self._keyed_turn, command, digest, run_id)
        turn = partial(refusing_if_unavailable, self.lifecycle, apply)
        shared = self._keyed_pass(command, digest, run_id)
        if command.op is not None and command.op.expected_position is not None:
            position = command.op.expected_position
            return self.scheduler.submit_at(stream, position, turn, shared=shared)
        beside = contextlib.ExitStack()
        beside.enter_context(self.scheduler.running_beside(stream))
        try:
            ticket = self.scheduler.queue(turn, lane=self.runs.lane_of(run_id), shared=shared)
        except BaseException:
            beside.close()
            raise
        ticket.add_done_callback(lambda _: beside.close())
        return ticket

    def _numbered(
        self,
        command: Command,
        digest: str,
        turn: Callable[[Command, str], Applied],
        shared: Shared | None = None,
    ) -> Ticket:
        """Queue ``command`` at its number in its stream (``digest`` the one its transport took
        of the request, which a re-send under that number must match); its ticket, which
        ``turn(command, run_id)`` resolves at the command's turn unless it does not run, or
        ``shared`` (whose ``end`` gives what ``turn`` gives) in a pass shared with other runs'
        calls."""
        assert command.stream is not None and command.number is not None
        # Asked by a pass that looks at it and again at its own turn: answered once.
        command = dataclasses.replace(command, runs_now=_answered_once(command.runs_now))
        ticket: Ticket = Ticket()
        if shared is not None:
            shared = _numbered_pass(command, shared, ticket)
        self.scheduler.submit(
            command.stream,
            command.number,
            digest,
            partial(settle, ticket, partial(self._numbered_turn, command, turn)),
            size=command.size,
            bounded=command.bounded,
            after_recovery=True,
            shared=shared,
        )
        return ticket

    def _numbered_turn(
        self, command: Command, turn: Callable[[Command, str], Applied]
    ) -> Applied | None:
        """A numbered command's turn, bound to its run as it is now (refused while the server
        shuts down); None when it was answered meanwhile."""
        if not command.runs_now():
            return None
        self.lifecycle.refuse_if_unavailable()
        return turn(command, self.runs.require(command.run_id).spec.run_id)

    def _numbered_keyed(self, command: Command, run_id: str, *, digest: KeyDigest) -> Applied:
        """Moves the run outside its positions: calls held for a position of the run wait
        meanwhile and look again once it ends."""
        with self.scheduler.running_beside(run_id):
            return self._keyed_turn(command, digest, run_id)

    def _numbered_read(self, command: Command, run_id: str) -> Applied:
        return Applied(_observed(command, self._read(command, run_id)))

    def _keyed_turn(
        self,
        command: Command,
        digest: KeyDigest,
        run_id: str,
        apply: Callable[[], tuple[Any, Durable]] | None = None,
    ) -> Applied:
        """``_apply_keyed`` (or ``apply``: its part after a shared pass), then its caller told
        (``Command.applied``)."""
        if apply is None:
            outcome, commit = self._apply_keyed(command, digest, run_id=run_id)
        else:
            outcome, commit = apply()
        return Applied(_observed(command, outcome), commit)

    def _apply_keyed(
        self, command: Command, digest: KeyDigest, *, run_id: str = ""
    ) -> tuple[Any, Durable]:
        active = self.runs.require(run_id)
        assert command.op is not None
        with self._keyed_failures(active):
            return keyed_path.apply_keyed(
                active, command.operation, command.request, command.op, digest
            )

    def _base_shared_by(self, run_id: str) -> SharedBase | None:
        """The base ``run_id``'s calls may share passes over; None for a run that computes
        alone (full weights, a sharded group, a server of one run) or is not open now (a
        request taken back before its run was restored runs alone)."""
        active = self.runs.find(run_id)
        return None if active is None else active.session.shared_base

    def _keyed_pass(self, command: Command, digest: KeyDigest, run_id: str) -> Shared | None:
        """What a keyed call does around a pass it shares with other runs' calls (None: it
        cannot share one): ``keyed_path.begin`` at its turn (refused as its solo call is, while
        unavailable or once its run closed) and the engine request; after the pass,
        ``keyed_path.end`` with the fields of its result, then ``Command.applied``, failures
        meaning what they mean alone (``_keyed_failures``)."""
        operation, op = command.operation, command.op
        together, base = operation.together, self._base_shared_by(run_id)
        if together is None or base is None or op is None:
            return None
        begun: list[tuple[ActiveRun, keyed_path.Begun]] = []

        def begin() -> Any:
            self.lifecycle.refuse_if_unavailable()
            run = self.runs.require(run_id)
            started = keyed_path.begin(run, operation, op, digest)
            if started.applying is None:
                return None  # replayed: answered from the journal at its own turn
            begun[:] = [(run, started)]
            return together.request(run, command.request)

        def end(result: Any) -> Applied:
            run, started = begun[0]

            def apply() -> tuple[Any, Durable]:
                with self._keyed_failures(run):
                    if isinstance(result, BaseException):
                        raise result
                    fields = together.fields(run, result)
                    return keyed_path.end(run, operation, command.request, op, started, fields)

            # Moves the run outside its positions, as its solo call does (``_numbered_keyed``).
            with self.scheduler.running_beside(run.spec.run_id):
                return self._keyed_turn(command, digest, run.spec.run_id, apply)

        return Shared(base, together.backward, begin, end)

    def _read_pass(self, command: Command, run_id: str) -> Shared | None:
        """What a read that may share a pass with other runs' reads of its kind (a forward)
        does around it (None: it cannot share one): refused at its turn as alone, then its
        outcome from the pass's result."""
        together, base = command.operation.together, self._base_shared_by(run_id)
        if together is None or base is None:
            return None

        def begin() -> Any:
            self.lifecycle.refuse_if_unavailable()
            return together.request(self.runs.require(run_id), command.request)

        def end(result: Any) -> Any:
            if isinstance(result, BaseException):
                raise result
            return together.fields(self.runs.require(run_id), result)

        return Shared(base, together.backward, begin, end)

    @contextlib.contextmanager
    def _keyed_failures(self, active: ActiveRun) -> Iterator[None]:
        """Around a keyed call's engine work and commit: what a failure means for the server,
        and the run's snapshot once it applied."""
        try:
            yield
        except JournalCommitFailed as error:  # an earlier operation's commit failed
            raise self.runs.journal_failed(error) from None
        except BaseException:
            if active.session.broken is not None:
                # Half applied: only a restart, which restores the latest checkpoint, makes the
                # session trustworthy again; the host fails the run (the server, where it is
                # the only one: health goes NOT_SERVING so a supervisor restarts it).
                self.runs.broke(active, f"{active.session.broken}; restart the server to restore")
            raise
        self.runs.applied(active)


def _answered_once(runs_now: Callable[[], bool]) -> Callable[[], bool]:
    """``runs_now``, whose False (the command was answered meanwhile: its answer is given as
    it is asked) stays False without asking again: a pass that looked at the command and its
    own turn after it then answer it once."""
    answered = False

    def once() -> bool:
        nonlocal answered
        answered = answered or not runs_now()
        return not answered

    return once


def _numbered_pass(command: Command, shared: Shared, ticket: Ticket) -> Shared:
    """A numbered command's part in a shared pass: it joins only if it still runs
    (``Command.runs_now``), and its ticket, not its job, answers what the pass gave it."""

    def begin() -> Any:
        return shared.begin() if command.runs_now() else None

    def end(result: Any) -> None:
        settle(ticket, partial(shared.end, result))

    return dataclasses.replace(shared, begin=begin, end=end)


def _observed(command: Command, outcome: Any) -> Any:
    """``outcome``, once ``command``'s caller was told of it (``Command.applied``)."""
    command.applied(outcome)
    return outcome
