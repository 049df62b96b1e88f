"""Every rank of a served sharded session runs the same engine calls in the same order.

A sharded ``TrainingSession`` is driven from rank 0 only: the server (its listeners, journal,
scheduler, recovery) lives there, and the other ranks hold shards and follow. Each engine call
that communicates with the other ranks (a forward all-gathers weights, a digest gathers every
shard, a checkpoint writes every rank's shards) must run on every rank, in the same order, with
the same arguments, or the collectives inside it pair up wrongly and hang.

So the session's methods that communicate are marked ``@collective``. On rank 0 of a served
group the session carries an ``Announcer`` (``session.announcer``): calling a marked method
first sends its name and arguments to the other ranks, which call the same method on their own
session (``server/group/follower.py``), then runs it here. Everything the service does to the
session therefore reaches every rank, whichever part of the service does it: the operation
table's engine calls, recovery's restore, a digest for ``GetSession``.

Two rules make the order the same everywhere. The announcement and the call are made under one
lock, so two threads of rank 0 cannot announce in one order and run in the other. A marked
method called from inside another (``save_state`` hashing the state) is not announced again:
the other ranks make that inner call themselves, inside their own outer one.

A call that fails may leave the ranks apart. A refusal (a bad argument, a damaged checkpoint
the ranks agreed on) is raised alike on every rank at the same point: each answers it and the
group goes on. Anything else (out of memory on one rank, a rank that died, a bug) may leave the
ranks at different collectives; the announcer hands it to ``on_failure``, which takes the group
down so it restarts from its latest checkpoint and journal (``server/group/leader.py``).

Without an announcer (one process, or an in-process group whose every rank calls each method
itself, as the tests do) a marked method is a plain call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from trainwire.server.errors import FailedPrecondition, TrainwireError, is_out_of_memory

Method = TypeVar("Method", bound=Callable[..., Any])


@dataclass(frozen=True)
class Call:
    """One engine call as rank 0 announces it: the method's name and its arguments."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


class Channel(Protocol):
    """Where rank 0's announcements go (``server/group/channel.py``)."""

    def send(self, message: Any) -> None: ...


def raised_alike_on_every_rank(error: BaseException) -> bool:
    """Whether every rank raises ``error`` at the same point of the same call: a refusal from a
    check every rank makes on the same arguments, or from an outcome the ranks agreed on.

    Anything that is not one of trainwire's refusals may be one rank's own, and so is a refusal
    raised while this process ran out of memory (the engine answers the allocator's failure
    with ``ResourceExhausted``, its cause or context). That is told by what the refusal was
    raised from, never by its words: a reworded message must not leave rank 0 in a collective
    the others have left, and a refusal that quotes a user's text ("out of memory" in a model
    path) must not take the group down."""
    if not isinstance(error, TrainwireError):
        return False
    return not any(_ran_out_of_memory(inner) for inner in _raised_from(error))


def _raised_from(error: BaseException) -> Iterator[BaseException]:
    """The exceptions ``error`` was raised from or while handling (``raise ... from None`` hides
    its context from a traceback, not from this)."""
    seen = {id(error)}
    pending = [error.__cause__, error.__context__]
    while pending:
        inner = pending.pop()
        if inner is None or id(inner) in seen:
            continue
        seen.add(id(inner))
        yield inner
        pending += [inner.__cause__, inner.__context__]


def _ran_out_of_memory(error: BaseException) -> bool:
    """An allocator's own failure: ``MemoryError``, ``torch.OutOfMemoryError``, or the CPU
    allocator's RuntimeError, which torch raises with no type of its own (so its words are
    all there is). trainwire's refusals are no allocator's failure."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return not isinstance(error, TrainwireError) and is_out_of_memory(error)


class Announcer:
    """Rank 0's side: tells the other ranks each collective call before making it.

    ``on_failure`` gets what a call raised when the ranks may no longer be in step (see
    ``raised_alike_on_every_rank``); it is expected not to return (it takes the group down).

    One announcer per session; the sessions a group builds one after another share ``lock``,
    so nothing of one interleaves with the next. Once a session is replaced its announcer is
    ``retire``d: the other ranks hold only the newest session, so a call to an older one must
    not reach them (they would make it on the newest).
    """

    def __init__(
        self,
        channel: Channel,
        on_failure: Callable[[BaseException], None],
        lock: threading.RLock | None = None,
    ) -> None:
        self._channel = channel
        self._on_failure = on_failure
        self._lock = lock or threading.RLock()
        self._depth = 0  # marked calls in progress on the thread holding the lock
        self._retired: str | None = None

    def retire(self, reason: str) -> None:
        """Refuse every later call with ``reason`` (FailedPrecondition), announcing nothing."""
        with self._lock:
            self._retired = reason

    @contextlib.contextmanager
    def turn(self, call: Call) -> Iterator[None]:
        """Hold the group for ``call``: announce it (unless nested in another), then run it."""
        with self._lock:
            if self._retired is not None:
                raise FailedPrecondition(f"{call.name}: {self._retired}")
            if self._depth == 0:
                self.send(call)
            self._depth += 1
            try:
                yield
            except BaseException as error:
                if not raised_alike_on_every_rank(error):
                    self._on_failure(error)
                raise
            finally:
                self._depth -= 1

    def send(self, message: Any) -> None:
        """A message to the other ranks (a call, or opening a session), in order with the calls.
        One that cannot be sent means a rank is gone: ``on_failure``."""
        with self._lock:
            try:
                self._channel.send(message)
            except BaseException as error:
                self._on_failure(error)
                raise


def collective(method: Method) -> Method:
    """Mark a ``TrainingSession`` method that every rank must call: announced on rank 0 of a
    served group before it runs (see the module docstring)."""

    @functools.wraps(method)
    def on_every_rank(session: Any, *args: Any, **kwargs: Any) -> Any:
        announcer: Announcer | None = session.announcer
        if announcer is None:
            return method(session, *args, **kwargs)
        with announcer.turn(Call(method.__name__, args, kwargs)):
            return method(session, *args, **kwargs)

    return on_every_rank  # type: ignore[return-value]
