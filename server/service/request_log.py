"""The intake's durable memory: every request it accepted and every result a crash could lose.

A client fetches results by the request ids it was given; after a SIGKILL the result store is empty.
So the intake appends each accepted request here and makes it durable before it hands out the
request id, and appends the result of each call the journal does not cover (a ``forward``, a sample,
any failure) before a fetch can see it. A restarted intake reads the records back in order: a
recorded result is final; a call without one is submitted again, and since the engine restarted from
its latest checkpoint, the keyed calls since then run again (the journal answers the ones before
it).

One JSON object per line, a typed record each (``request_records``). A line torn by the crash (the
write was never made durable, so its request id was never handed out) is dropped. ``compact``
rewrites the file atomically, keeping what a restart still needs and nothing more (``compacted``):
the requests since the latest checkpoint, the samples not yet answered, and the results a client can
still ask for (``results``'s retention bounds them in time, count and bytes), each carried in one
record with its payload's digest once its request's record is gone; none of a client session the
intake forgot (``Intake.forget_sessions``).

In memory the log keeps what compaction and the routes ask of its records (ids, seq_ids, small
bodies); a heavy body (a ``forward_backward``'s protobuf, a long prompt, a large result) stays in
the file (``OnDisk``) and compaction copies its line as it was written, so what a process holds does
not grow with the calls a run sends between two checkpoints.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from trainwire.server.errors import ResourceExhausted
from trainwire.server.service.request_records import (
    CallRecord,
    Record,
    ResultRecord,
    SampleRecord,
    record_from_json,
)
from trainwire.server.service.results import Done, Failed, Outcome

logger = logging.getLogger(__name__)

LOG_FILE = "requests.jsonl"
# A record whose line is this long keeps its body in the file only: a run that never saves a
# checkpoint would otherwise hold every forward_backward body it was sent in memory until the
# next compaction. Requests' small fields (ids, seq_ids, a load's path) stay in memory.
HEAVY_LINE_BYTES = 4096


@dataclass(frozen=True)
class OnDisk:
    """A body left in the file: its record's line is ``length`` bytes at ``offset``. Only
    ``RequestLog.compact`` reads it back, copying the line as it was written."""

    offset: int
    length: int


def compacted(
    records: list[Record],
    seq_id: int,
    settled: Callable[[str], bool],
    head: list[Record],
    carry: Callable[[list[str]], list[ResultRecord]] | None = None,
) -> list[Record] | None:
    """The records to keep after a checkpoint at ``seq_id``: ``head`` (sessions, notes, where to
    resume), the results ``carry`` keeps of the requests whose records go, the calls
    from ``seq_id`` on and the samples not ``settled`` yet, with their results.

    ``settled(request_id)``: the request needs its record no more (answered, or its result
    carried). None while a call before the checkpoint is not: it may still be asked for.
    ``carry`` is given the request ids whose records go, in log order (none: nothing carried).
    """
    calls = [r for r in records if isinstance(r, CallRecord)]
    before = [r.request_id for r in calls if r.seq < seq_id]
    if not before or not all(settled(request_id) for request_id in before):
        return None
    since = {r.request_id for r in calls if r.seq >= seq_id}  # the engine replays these
    samples = {r.request_id for r in records if isinstance(r, SampleRecord)}
    kept = since | {request_id for request_id in samples if not settled(request_id)}
    requests = [r for r in records if isinstance(r, CallRecord | SampleRecord | ResultRecord)]
    gone = [r.request_id for r in requests if r.request_id not in kept]
    carried = carry(list(dict.fromkeys(gone))) if carry is not None else []
    return head + carried + [r for r in requests if r.request_id in kept]


class RequestLog:
    """An append-only, fsync'd record file; appends from many threads share their fsyncs."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / LOG_FILE
        self._lock = threading.Lock()  # orders writes
        self._sync_lock = threading.Lock()  # one fsync at a time; a waiter may find it done
        self._written = 0  # records written (flushed to the OS)
        self._synced = 0  # records known durable
        self._read_lines: list[tuple[int, int]] = []  # where each record read at start lies
        self._reader: int | None = None  # reads back bodies left in the file (``calls``)
        self.records = self._read()
        self._fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _read(self) -> list[Record]:
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if complete < len(data):  # a record torn by the crash: never durable, never answered
            logger.warning("%s: dropped a torn last record", self.path)
            with self.path.open("r+b") as file:
                file.truncate(complete)
        records: list[Record] = []
        offset = 0
        for number, line in enumerate(data[:complete].splitlines(keepends=True), 1):
            try:
                records.append(record_from_json(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{self.path}: record {number} is corrupt") from None
            self._read_lines.append((offset, len(line)))
            offset += len(line)
        return records

    def leave_bodies_on_disk(self) -> None:
        """Once the records read at start were taken back (they needed their bodies), keep the
        heavy ones' bodies in the file only, as ``append`` does for new ones."""
        with self._lock:
            lines = self._read_lines
            if len(lines) <= len(self.records):
                read = self.records[: len(lines)]
                light = [_light(r, *line) for r, line in zip(read, lines, strict=True)]
                self.records[: len(lines)] = light
            self._read_lines = []

    def append(self, record: Record) -> int:
        """Write ``record`` (not yet durable); returns its ticket for ``sync``."""
        line = _line(record)
        with self._lock:
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(self._fd, view) :]
            except OSError as error:
                os.ftruncate(self._fd, start)  # no half record for later ones to follow
                if error.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ResourceExhausted(
                        "the disk is full: the request is not accepted"
                    ) from None
                raise
            self._written += 1
            self.records.append(_light(record, start, len(line)))
            return self._written

    def calls(self, route: str) -> tuple[list[CallRecord], set[str]]:
        """The logged calls of ``route`` whole (a body left in the file read back), and the
        request ids whose result is recorded; as of one moment (no append or compaction
        meanwhile)."""
        with self._lock:
            calls = [r for r in self.records if isinstance(r, CallRecord) and r.route == route]
            answered = {r.request_id for r in self.records if isinstance(r, ResultRecord)}
            whole = [self._whole(call) for call in calls]
        return whole, answered

    def _whole(self, call: CallRecord) -> CallRecord:
        if not isinstance(call.body, OnDisk):
            return call
        line = os.pread(self._fd_for_reading(), call.body.length, call.body.offset)
        record = record_from_json(json.loads(line))
        assert isinstance(record, CallRecord) and record.request_id == call.request_id
        return record

    def _fd_for_reading(self) -> int:
        if self._reader is None:
            self._reader = os.open(self.path, os.O_RDONLY)
        return self._reader

    def sync(self, ticket: int) -> None:
        """Return once the record with ``ticket`` is on disk (one fsync may cover many)."""
        with self._sync_lock:
            if self._synced >= ticket:
                return
            with self._lock:
                covered = self._written
                fd = self._fd
            os.fsync(fd)
            self._synced = covered

    def write(self, record: Record) -> None:
        """``append`` and ``sync``: the record is durable when this returns."""
        self.sync(self.append(record))

    def write_result(self, request_id: str, outcome: Outcome, at: float | None = None) -> Outcome:
        """Write a result (resolved ``at``) durably; what a fetch may then see: the outcome, or a
        server error if it could not be written (a restart runs its call again)."""
        try:
            self.write(ResultRecord(request_id, outcome, resolved_at=at))
        except (OSError, ResourceExhausted) as error:
            logger.error("the result of %s was not recorded: %s", request_id, error)
            return Failed(f"the result could not be recorded durably ({error})", "server")
        return outcome

    def compact(self, choose: Callable[[list[Record]], list[Record] | None]) -> bool:
        """Replace the file by ``choose(records)`` (None: keep it as it is), durably and
        atomically: a crash leaves the old file or the new. No record is appended meanwhile, so
        none is lost between choosing and replacing. True when it was replaced."""
        with self._sync_lock, self._lock:
            kept = choose(list(self.records))
            if kept is None:
                return False
            temporary = self.path.with_suffix(".tmp")
            written = []
            with temporary.open("wb") as file, self.path.open("rb") as old:
                for record in kept:
                    stored = _on_disk(record)
                    if stored is None:
                        line = _line(record)
                    else:  # copied as written, never decoded: a body is read once, at a restart
                        line = os.pread(old.fileno(), stored.length, stored.offset)
                    written.append(_light(record, file.tell(), len(line)))
                    file.write(line)
                file.flush()
                os.fsync(file.fileno())
            kept = written
            os.close(self._fd)
            if self._reader is not None:  # it reads the old file: the next read opens the new
                os.close(self._reader)
                self._reader = None
            temporary.replace(self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            self._fd = self._open()
            self.records = kept
            self._read_lines = []  # the records read at start are rewritten with their places
            self._synced = self._written  # the kept records are durable, the others gone on purpose
        logger.debug("%s compacted to %d records", self.path, len(kept))
        return True

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
            if self._reader is not None:
                os.close(self._reader)
                self._reader = None


def _light(record: Record, offset: int, length: int) -> Record:
    """``record`` as the log keeps it in memory: a heavy line's body left in the file."""
    if length < HEAVY_LINE_BYTES or _on_disk(record) is not None:
        return record
    stored = OnDisk(offset, length)
    if isinstance(record, CallRecord | SampleRecord):
        return replace(record, body=stored)  # type: ignore[arg-type]
    if isinstance(record, ResultRecord) and isinstance(record.outcome, Done):
        return replace(record, outcome=Done(stored))  # type: ignore[arg-type]
    return record


def _on_disk(record: Record) -> OnDisk | None:
    """Where ``record``'s body is in the file, when it is left there."""
    if isinstance(record, CallRecord | SampleRecord) and isinstance(record.body, OnDisk):
        return record.body
    if isinstance(record, ResultRecord) and isinstance(record.outcome, Done):
        body = record.outcome.body
        return body if isinstance(body, OnDisk) else None
    return None


def _line(record: Record) -> bytes:
    """One record as the one line of JSON the file holds."""
    return json.dumps(record.to_json(), sort_keys=True, separators=(",", ":")).encode() + b"\n"
