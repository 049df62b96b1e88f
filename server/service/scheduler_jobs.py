"""What the scheduler queues: a job, the bounds it holds, and what orders it.

A job knows its *lane* (a run's id on a server of many runs, "" on a server of one: lanes take
fair turns), its *account* (a tenant, "" on a server without tenants: every bound is that
account's), what holds its place (a ``Holder``: a numbered stream, or an account's samples, or
nothing for a call its caller waits on), its size in bytes, and its kind: a plain call (a keyed
operation, a read, a lifecycle call) runs alone; a sample may decode in one batch with the
samples queued next to it in its lane (``sample_batching``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from trainwire.server.service.sample_batching import PreparedSample


@dataclass(frozen=True)
class Samples:
    """What one account's jobs outside any stream's order (its samples) are bounded under."""

    account: str


Holder = str | Samples  # a numbered stream, or an account's samples


@dataclass(eq=False)
class Job:
    """One unit of the engine's work, answered through ``done`` once it has ended.

    ``call`` runs a plain job; a sample job has ``prepare`` instead, which says (on the engine
    thread, at its turn) which run and weights it reads, or None when nothing is to run (its
    ticket was answered meanwhile). ``holder`` None: a call counted by its caller's admission
    only. ``after_recovery``: it waits until the server restored its runs (a request a
    transport accepted before a restart)."""

    call: Callable[[], Any] | None = None
    prepare: Callable[[], PreparedSample | None] | None = None
    lane: str = ""
    holder: Holder | None = None
    size: int = 0
    account: str = ""
    after_recovery: bool = False
    done: futures.Future[Any] = field(default_factory=futures.Future)
    arrival: int = 0  # its place among everything queued (a barrier waits for lower ones)
    prepared: PreparedSample | None = None  # a sample job's ``prepare()``, once made
    # What the engine made of it, given to ``done`` once the job has ended.
    outcome: futures.Future[Any] | None = None

    @property
    def is_sample(self) -> bool:
        return self.prepare is not None
