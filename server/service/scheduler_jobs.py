"""What the scheduler queues: a job, the bounds it holds, and what orders it.

A job knows its *lane* (a run's id on a server of many runs, "" on a server of one: lanes take
fair turns), its *account* (a tenant, "" on a server without tenants: every bound is that
account's), what holds its place (a ``Holder``: a numbered stream, or an account's samples, or
nothing for a call its caller waits on), its size in bytes, and its kind: a plain call (a keyed
operation, a read, a lifecycle call) runs alone; a sample may decode in one batch with the
samples queued next to it in its lane (``sample_batching``); a call with a ``Shared`` part (a
LoRA run's forward_backward or forward) may run in one pass over its base with the calls at the
heads of other lanes (``shared_passes``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from trainwire.server.engine.together import Request, Result
from trainwire.server.service.sample_batching import PreparedSample


@dataclass(frozen=True)
class Samples:
    """What one account's jobs outside any stream's order (its samples) are bounded under."""

    account: str


Holder = str | Samples  # a numbered stream, or an account's samples


@dataclass(frozen=True)
class Shared:
    """A job's part in a pass it may share with other runs' jobs, beside its solo ``call``.

    ``base``: what the runs share (only jobs on one base meet); ``backward``: a forward_backward
    (else a forward: a pass runs one kind). On the engine thread: ``begin()`` does what the solo
    call does before the engine, changing nothing, and gives the engine request (None: the job
    needs no engine call, e.g. a replayed key, and runs alone); it raises what the solo call
    would raise (the job then runs alone and meets it). After the pass, ``end(result or
    error)`` does what the solo call does after the engine and returns the job's answer (or
    raises its error)."""

    base: object
    backward: bool
    begin: Callable[[], Request | None]
    end: Callable[[Result | BaseException], Any]


@dataclass(eq=False)
class Job:
    """One unit of the engine's work, answered through ``done`` once it has ended.

    ``call`` runs a plain job; a sample job has ``prepare`` instead, which says (on the engine
    thread, at its turn) which run and weights it reads, or None when nothing is to run (its
    ticket was answered meanwhile). ``holder`` None: a call counted by its caller's admission
    only. ``after_recovery``: it waits until the server restored its runs (a request a
    transport accepted before a restart). ``shared``: it may run in a pass shared with other
    lanes' jobs (see ``Shared``)."""

    call: Callable[[], Any] | None = None
    prepare: Callable[[], PreparedSample | None] | None = None
    lane: str = ""
    holder: Holder | None = None
    size: int = 0
    account: str = ""
    after_recovery: bool = False
    shared: Shared | None = None
    done: futures.Future[Any] = field(default_factory=futures.Future)
    arrival: int = 0  # its place among everything queued (a barrier waits for lower ones)
    prepared: PreparedSample | None = None  # a sample job's ``prepare()``, once made
    # What the engine made of it, given to ``done`` once the job has ended.
    outcome: futures.Future[Any] | None = None

    @property
    def is_sample(self) -> bool:
        return self.prepare is not None
