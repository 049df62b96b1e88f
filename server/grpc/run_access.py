"""Which run a gRPC caller may reach: only runs its own tenant opened.

A call names its run (or the server's only open run), whoever opened it (a gRPC client or the
Tinker front). A run id that is not the caller's answers NOT_FOUND with the same words whether
another tenant holds it or nobody ever opened it (``not_yours``): a difference would tell a
tenant which run ids exist. A call naming no run, when the only open run is another tenant's,
answers NOT_FOUND without naming it. The calls of a port without keys (loopback, no
``--token-file``) reach any run, as before tenants. The owner of each run id is
``RunOwners``'s. On a server of one run at a time, another tenant's open run also keeps a caller
from opening one (without naming it); on a server of many runs (``--max-runs``) each tenant
opens its own beside the others', up to its ``max_runs``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainwire.contract.outcomes import SessionInfo
from trainwire.server.errors import FailedPrecondition, NotFound, Unauthenticated
from trainwire.server.grpc.auth import caller_of
from trainwire.server.service.host import SessionHost
from trainwire.server.service.run_owners import RunOwners, not_yours
from trainwire.server.service.tenants import Tenants

NO_RUN_OF_YOURS = "no run of this key is open on this server; Open one first"
ANOTHER_CLIENTS_RUN = (
    "another client's run is open on this server (one server, one run): open yours once it "
    "has closed, or use another server"
)


class RunAccess:
    """The tenant checks of every call: ``caller`` says who calls, the rest refuse what is not
    theirs before the host sees the call."""

    def __init__(self, tenants: Tenants, owners: RunOwners, host: SessionHost) -> None:
        self.tenants = tenants
        self.owners = owners
        self.host = host

    def caller(self, metadata: Iterable[tuple[str, Any]] | None) -> str:
        """The calling tenant's name (the interceptor let only tenants' keys through)."""
        tenant = caller_of(self.tenants, metadata)
        if tenant is None:
            raise Unauthenticated("missing or wrong bearer token")
        return tenant.name

    def check_run(self, caller: str, run_id: str, bound: str) -> None:
        """Before a call naming ``run_id`` ("" names the server's only open run, which the call
        was ``bound`` to): NotFound unless that run is the caller's (``check_named`` for a run
        the call named)."""
        if run_id:
            self.check_named(caller, run_id)
        elif bound and not self.owners.holds(bound, caller):
            raise NotFound(NO_RUN_OF_YOURS)

    def check_named(self, caller: str, run_id: str) -> None:
        """NotFound for a run id that is not the caller's, in the same words whether another
        tenant holds it or nobody ever opened it."""
        if not self.owners.holds(run_id, caller):
            raise NotFound(not_yours(run_id))

    def check_open(self, caller: str, run_id: str) -> None:
        """An Open's admission, run by the host atomically with the open (``SessionHost.open``'s
        ``admit``, on its engine thread, so no other open or close lands between this count and the
        open it admits): ``run_id`` another tenant's, or on a server of one run another tenant's
        run open, refused without naming it; the caller's ``max_runs``; then ``run_id`` is the
        caller's."""
        open_ids = self.host.open_run_ids
        if self.host.max_runs == 1:
            others = [r for r in open_ids if not self.owners.holds(r, caller)]
            if others:
                raise FailedPrecondition(ANOTHER_CLIENTS_RUN)
        if run_id not in open_ids:  # confirming an open run of its own is never past a limit
            own = sum(1 for r in open_ids if self.owners.holds(r, caller))
            self.tenants.check_run_limit(caller, own)
        self.owners.claim(run_id, caller)

    def check_close(self, caller: str, run_id: str) -> None:
        """Before a Close: of the open run (``run_id`` empty) or of ``run_id``, the caller's;
        on a server of one run, another tenant's open run is never named."""
        open_id = self.host.open_run_id
        self.check_run(caller, run_id, run_id or open_id or "")
        another_open = open_id is not None and not self.owners.holds(open_id, caller)
        if self.host.max_runs == 1 and run_id and run_id != open_id and another_open:
            raise FailedPrecondition(f"run {run_id!r} is not the open run; nothing was closed")

    def visible(self, caller: str, info: SessionInfo) -> SessionInfo:
        """``info`` when it describes the caller's run (or none); NotFound for another's (the
        run closed last, the one open or the one being restored)."""
        if info.run_id and not self.owners.holds(info.run_id, caller):
            raise NotFound(NO_RUN_OF_YOURS)
        return info
