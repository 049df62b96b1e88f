"""``trainwire runs STATE_DIR``: every open run of a server, with who holds it and how long it
has been quiet, so an operator can see which slots are held and close the abandoned ones.

A server of many runs (``--max-runs``) holds a slot for each open run until it is closed: a
script that ended without closing its client, or a run restored from before ``--tenants``,
keeps one. The Tinker front gives an abandoned model's slot to a new model by itself; a gRPC
client sends no heartbeat, so its run waits for ``trainwire close``. This listing reads the
state directory only (as ``trainwire inspect`` does, while the server holds it): for each run
its Tinker model id (the id the SDK printed, which ``trainwire close --run-id`` takes), its
owner (the tenant whose key opened it), its age and its last operation.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from trainwire.inspection import journal_summary


@dataclass(frozen=True)
class OpenRun:
    """One open run as the state directory records it."""

    run_id: str
    model_id: str  # the Tinker model it trains ("" for a gRPC client's run)
    owner: str
    opened_at: float  # when its run.json was written (it is rewritten only when it closes)
    last_operation_at: float | None  # its journal's last live entry (None: none yet)
    last_operation: str  # that entry's kind ("" without one)
    position: int


def open_runs(state_dir: Path) -> list[OpenRun]:
    """The runs ``state_dir`` records open, by run id; nothing is written."""
    from trainwire.server.service.run_owners import OWNERS_FILE
    from trainwire.server.service.state_dir import RUN_FILE, RUN_OPEN, RUNS_DIR, RunDirectory
    from trainwire.server.service.tenants import DEFAULT_TENANT  # a single key's, or older data

    owners = _read_owners(state_dir / OWNERS_FILE)
    models = _tinker_models(state_dir)
    found = []
    for folder in sorted(p for p in (state_dir / RUNS_DIR).iterdir() if (p / RUN_FILE).is_file()):
        spec = RunDirectory(folder).read_spec()
        if spec.state != RUN_OPEN:
            continue
        summary = journal_summary(state_dir, spec.run_id)
        found.append(
            OpenRun(
                run_id=spec.run_id,
                model_id=models.get(spec.run_id, ""),
                owner=owners.get(spec.run_id, DEFAULT_TENANT),
                opened_at=(folder / RUN_FILE).stat().st_mtime,
                last_operation_at=summary.last_at,
                last_operation=summary.last_kind,
                position=summary.position,
            )
        )
    return found


def describe_open_runs(state_dir: Path, now: float | None = None) -> str:
    """A table of ``open_runs`` (ages from ``now``, default the clock), and how to close one."""
    from trainwire.server.service.state_dir import LOCK_FILE, RUNS_DIR

    if not ((state_dir / RUNS_DIR).is_dir() and (state_dir / LOCK_FILE).is_file()):
        raise ValueError(f"{state_dir}: not a server's state directory (no {RUNS_DIR}/ in it)")
    now = time.time() if now is None else now
    runs = open_runs(state_dir)
    if not runs:
        return f"no open run in {state_dir}"
    header = ("RUN", "TINKER MODEL", "OWNER", "OPENED", "LAST OPERATION", "POSITION")
    rows = [header]
    for run in runs:
        last = "none yet"
        if run.last_operation_at is not None:
            last = f"{_ago(now - run.last_operation_at)} ({run.last_operation})"
        opened = _ago(now - run.opened_at)
        rows.append((run.run_id, run.model_id or "-", run.owner, opened, last, str(run.position)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [_aligned(row, widths) for row in rows]
    lines += [
        "",
        f"{len(runs)} open run(s). Close one with: trainwire close --server HOST:PORT --run-id "
        "RUN (or the TINKER MODEL id), with the owner's key (--token-file)",
    ]
    return "\n".join(lines)


def _aligned(row: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()


def _ago(seconds: float) -> str:
    """``seconds`` in the largest whole unit, as an age ("42 s ago", "5 min ago", "3 h ago")."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return f"{int(seconds)} s ago"


def _read_owners(path: Path) -> dict[str, str]:
    """The run owners file (run id → tenant); empty where there is none."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is damaged: expected {{run id: tenant}}")
    return {str(run_id): str(tenant) for run_id, tenant in data.items()}


def _tinker_models(state_dir: Path) -> dict[str, str]:
    """The Tinker front's open models: run id → model id (read, never moved or rewritten)."""
    from trainwire.server.tinker.front import FRONT_DIR
    from trainwire.server.tinker.model import MODELS_DIR

    folder = state_dir / FRONT_DIR / MODELS_DIR
    models = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = json.loads(path.read_text())
        models[str(record["run_id"])] = str(record["model_id"])
    return models
