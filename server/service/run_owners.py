"""Which tenant each run belongs to, kept in the state directory so a restart knows it.

Run ids are one namespace for every transport: a gRPC client names its run, the Tinker front
names its models' runs. The first tenant to open a run id owns it for good, closed or not (a
closed run's checkpoints stay on disk), and another tenant's calls on it answer NOT_FOUND.

Only runs of tenants other than ``default`` are written down (``run_owners.json``, replaced
atomically on every claim): a run on disk with no entry is ``default``'s, which is what a server
with a single key (or none) wrote before it had tenants, and what it keeps writing.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from trainwire.contract.files import write_text_atomic
from trainwire.server.errors import NotFound
from trainwire.server.service.state_dir import StateDirectory
from trainwire.server.service.tenants import DEFAULT_TENANT

OWNERS_FILE = "run_owners.json"


def not_yours(run_id: str) -> str:
    """What a tenant hears of a run id another tenant holds: nothing about that run."""
    return f"no run {run_id!r} of this key on this server; open a run id of your own"


class RunOwners:
    """The owner of every run id a tenant other than ``default`` opened."""

    def __init__(self, state_dir: StateDirectory) -> None:
        self.state_dir = state_dir
        self._path = state_dir.root / OWNERS_FILE
        self._lock = threading.Lock()
        self._owners: dict[str, str] = {}
        if self._path.is_file():
            data: Any = json.loads(self._path.read_text())
            if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
                raise ValueError(f"{self._path} is damaged: expected {{run id: tenant}}")
            self._owners = dict(data)

    def owner(self, run_id: str) -> str | None:
        """Who holds ``run_id``: its tenant, ``default`` for a run on disk with no entry, None
        for a run id nobody opened."""
        with self._lock:
            owner = self._owners.get(run_id)
        if owner is not None:
            return owner
        return DEFAULT_TENANT if self.state_dir.run(run_id).exists() else None

    def claim(self, run_id: str, tenant: str) -> None:
        """Make ``tenant`` the owner of ``run_id`` before it opens; NotFound (nothing changes)
        when another tenant holds it."""
        with self._lock:
            owner = self._owners.get(run_id)
            if owner is None and self.state_dir.run(run_id).exists():
                owner = DEFAULT_TENANT
            if owner is not None and owner != tenant:
                raise NotFound(not_yours(run_id))
            if owner is None and tenant != DEFAULT_TENANT:
                self._owners[run_id] = tenant
                write_text_atomic(self._path, json.dumps(self._owners, sort_keys=True))

    def release(self, run_id: str, tenant: str) -> None:
        """Give back ``tenant``'s claim on ``run_id`` when no run of that id is on disk (a
        copy that failed before its run was written): the id is nobody's again. A run on disk
        keeps its owner for good."""
        with self._lock:
            if self._owners.get(run_id) != tenant or self.state_dir.run(run_id).exists():
                return
            del self._owners[run_id]
            write_text_atomic(self._path, json.dumps(self._owners, sort_keys=True))

    def holds(self, run_id: str | None, tenant: str) -> bool:
        """Whether ``tenant`` holds ``run_id`` (a run id nobody opened is nobody's)."""
        return run_id is not None and self.owner(run_id) == tenant
