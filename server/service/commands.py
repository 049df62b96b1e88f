"""What a transport submits to the service (a ``Command``) and what its ticket resolves with.

Both transports decode a request into the same command: an operation of the table
(``operations``), its typed request, the run it is for and the tenant it counts against, and
what orders it: a keyed operation's key (its ``OperationSpec``), with either the position its
caller expects the run at (gRPC's ``expected_position``) or its number in a stream its
transport numbers (a Tinker model's ``seq_id``). ``SessionHost.submit`` queues it and hands
back its ticket, a future that the engine thread resolves once the operation ran; a gRPC
handler waits on it, the Tinker intake answers its request id from it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from trainwire.contract.outcomes import OperationSpec
from trainwire.server.service.active_run import Durable
from trainwire.server.service.operations import Operation


def _nothing(outcome: Any) -> None:
    return None


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Command:
    """One request for the service.

    Args:
        operation: the entry of the operation table it runs.
        request: its typed request (``operation.request_type``), checked before it is submitted.
        run_id: the run it is for ("" the server's only open run).
        op: a keyed operation's key, the position its caller expects the run at (gRPC's
            ``expected_position``; None: no position) and whether its outcome carries the
            run's state digest; None for a read.
        stream: the stream its transport numbers it in (a Tinker model), or None. A numbered
            command was accepted already: it waits until the server restored its runs, is never
            refused for what other tenants send, and is bound to its run at its turn.
        number: its number in ``stream`` (a Tinker ``seq_id``).
        digest: the digest its transport took of the body it received (the one hash of a
            request; the journal binds the key to it); None: the payload's.
        account: the tenant whose bounds it counts against ("" a server without tenants).
        size: the bytes it holds while it waits (a numbered command's).
        bounded: whether the stream's bounds refuse it (False for what a restart takes back).
        runs_now: asked at its turn, on the engine thread: False when it was answered meanwhile
            (nothing runs, and the ticket resolves with None).
        applied: told the operation's outcome on the engine thread once it applied (or the
            journal answered it), before the next job runs: how a transport observes what it
            records beside the operation (``Intake.applied``). A failure raised there fails
            the command as the operation's own would.
    """

    operation: Operation[Any]
    request: Any
    run_id: str = ""
    op: OperationSpec | None = None
    stream: str | None = None
    number: int | None = None
    digest: str | None = None
    account: str | None = ""
    size: int = 0
    bounded: bool = True
    runs_now: Callable[[], bool] = _always
    applied: Callable[[Any], None] = _nothing


@dataclass(frozen=True)
class Applied:
    """What a command's ticket resolves with: its outcome, and the commit its answer must wait
    for (None: on disk already, or a read, which has nothing to commit)."""

    outcome: Any
    commit: Durable = None


Ticket = Future  # a command's ticket: resolves with its ``Applied``, or None when it did not run


def settle(ticket: Future[Any], call: Callable[[], Any]) -> None:
    """Resolve ``ticket`` with what ``call()`` returns, or the error it raises."""
    try:
        ticket.set_result(call())
    except BaseException as error:  # the ticket's waiter hears every failure
        ticket.set_exception(error)


def chained(answer: Future[Any], make: Callable[[Any], Any]) -> Future[Any]:
    """A future of ``make(answer's result)`` (or of its error), done when ``answer`` is."""
    ticket: Future[Any] = Future()
    answer.add_done_callback(lambda done: settle(ticket, lambda: make(done.result())))
    return ticket
