"""The controller's durable records in its work directory.

``cursor.json`` says how far the run has committed: the server position after the last completed
microbatch and the replay state at that point. ``snapshots/<position>.json`` holds the replay
state at each server checkpoint, written before the checkpoint is asked for, so a server that
restarts from any checkpoint can be met at exactly that point. Every file is written atomically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract.files import write_text_atomic
from trainwire.contract.run.replay import RunState

CURSOR_FILE = "cursor.json"
SNAPSHOT_DIR = "snapshots"
CURSOR_FORMAT = "trainwire.cursor/v1"


@dataclass
class Record:
    """The replay state as of a server position."""

    position: int
    state: RunState


class WorkDirectory:
    """One run's work directory, bound to one run id and one manifest."""

    def __init__(self, path: str | Path, *, run_id: str, manifest_fingerprint: str) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self.manifest_fingerprint = manifest_fingerprint

    def bind(self) -> None:
        """Create the directory, or refuse one that belongs to another run or manifest."""
        self.path.mkdir(parents=True, exist_ok=True)
        cursor = self._read(self.path / CURSOR_FILE)
        if cursor is not None and cursor["manifest_fingerprint"] != self.manifest_fingerprint:
            raise ValueError(
                f"{self.path} holds run {cursor['run_id']!r} of manifest "
                f"{cursor['manifest_fingerprint']}, not {self.manifest_fingerprint}; "
                "use another work directory for another manifest"
            )
        if cursor is not None and cursor["run_id"] != self.run_id:
            raise ValueError(
                f"{self.path} holds run {cursor['run_id']!r}, not {self.run_id!r}; resume it "
                "with its own run id or use another work directory"
            )
        self.records()  # snapshots of another run, even one that never wrote a cursor

    def _read(self, path: Path) -> dict[str, Any] | None:
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        if data.get("format") != CURSOR_FORMAT:
            raise ValueError(f"{path}: not a {CURSOR_FORMAT} file")
        return data

    def _write(self, path: Path, record: Record) -> None:
        data = {
            "format": CURSOR_FORMAT,
            "run_id": self.run_id,
            "manifest_fingerprint": self.manifest_fingerprint,
            "position": record.position,
            "state": record.state.to_dict(),
        }
        write_text_atomic(path, json.dumps(data, sort_keys=True))

    def write_cursor(self, record: Record) -> None:
        self._write(self.path / CURSOR_FILE, record)

    def write_snapshot(self, record: Record) -> None:
        self._write(self.path / SNAPSHOT_DIR / f"{record.position}.json", record)

    def records(self) -> list[Record]:
        """The cursor and every snapshot, as records."""
        paths = [self.path / CURSOR_FILE, *sorted((self.path / SNAPSHOT_DIR).glob("*.json"))]
        out = []
        for path in paths:
            data = self._read(path)
            if data is None:
                continue
            if (data["run_id"], data["manifest_fingerprint"]) != (
                self.run_id,
                self.manifest_fingerprint,
            ):
                raise ValueError(
                    f"{path} belongs to run {data['run_id']!r} of manifest "
                    f"{data['manifest_fingerprint']}; use another work directory"
                )
            out.append(Record(data["position"], RunState.from_dict(data["state"])))
        return out

    def resume_point(self, server_position: int, start: RunState) -> Record:
        """The record to resume from when the server stands at ``server_position``.

        The most advanced record at or before the server: operations between it and the server
        were journaled, so replaying their keys returns their recorded results (the caller checks
        that they lie within the next microbatch). A record beyond the server means the server
        restored an older checkpoint: its snapshot is the way back.
        """
        candidates = [Record(0, start), *self.records()]
        usable = [record for record in candidates if record.position <= server_position]
        return max(usable, key=lambda record: record.position)
