"""Receiving an export stream: files written into a staging directory, every byte checked
against the sizes and sha256 the server recorded, the directory swapped in only when all match.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from trainwire.client import chunks, outcomes, wire
from trainwire.client.files import atomic_directory
from trainwire.v1 import session_pb2 as pb


class DownloadError(RuntimeError):
    """Downloaded export files do not match what the server recorded; nothing was kept."""


ExportItem = pb.ExportWeightsResponse | chunks.RawChunk


def receive_export(
    stream: Iterator[ExportItem], download_to: str | Path | None
) -> outcomes.ExportOutcome:
    first = next(stream)
    if isinstance(first, chunks.RawChunk) or first.WhichOneof("item") != "result":
        raise DownloadError("the export stream did not start with its result")
    outcome = wire.export_outcome_from_proto(first.result)
    if download_to is None:
        return outcome
    target = Path(download_to)
    with atomic_directory(target) as staging:
        _receive_files(stream, staging, outcome.files)
    return replace(outcome, directory=target)


class _IncomingFile:
    def __init__(self, staging: Path, path: str) -> None:
        self.path = path
        self.local = staging / _safe_relative(path)
        self.local.parent.mkdir(parents=True, exist_ok=True)
        self.handle: BinaryIO = open(self.local, "wb")  # noqa: SIM115 (closed by finish)
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, offset: int, data: memoryview) -> None:
        if offset != self.size:
            raise DownloadError(f"{self.path}: chunk at offset {offset}, expected {self.size}")
        self.handle.write(data)
        self.sha256.update(data)
        self.size += len(data)

    def finish(self, end: pb.FileEnd, recorded: outcomes.ExportedFile) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        got = (self.size, self.sha256.hexdigest())
        for what, expected in (("the stream", end), ("the export's record", recorded)):
            if got != (expected.size_bytes, expected.sha256):
                raise DownloadError(
                    f"{self.path}: received {got[0]} bytes with sha256 {got[1]}, but {what} says "
                    f"{expected.size_bytes} bytes with sha256 {expected.sha256}; export it again"
                )


def _pieces(stream: Iterator[ExportItem]) -> Iterator[chunks.RawChunk | pb.FileEnd]:
    """The stream's chunks (as ``RawChunk``) and file ends, after the result."""
    for item in stream:
        if isinstance(item, chunks.RawChunk):
            yield item
        elif item.WhichOneof("item") == "chunk":  # not one of our pre-encoded chunks
            yield chunks.RawChunk(item.chunk.path, item.chunk.offset, memoryview(item.chunk.data))
        elif item.WhichOneof("item") == "file_end":
            yield item.file_end
        else:
            raise DownloadError("the export stream sent a second result")


def _receive_files(
    stream: Iterator[ExportItem], staging: Path, files: Sequence[outcomes.ExportedFile]
) -> None:
    recorded = {file.path: file for file in files}
    received: list[str] = []
    current: _IncomingFile | None = None
    try:
        for piece in _pieces(stream):
            if piece.path not in recorded:
                raise DownloadError(f"the server sent {piece.path!r}, which the export lacks")
            if current is None or current.path != piece.path:
                if current is not None:
                    raise DownloadError(f"{current.path}: the stream moved on before its end")
                current = _IncomingFile(staging, piece.path)
            if isinstance(piece, chunks.RawChunk):
                current.write(piece.offset, piece.data)
            else:
                current.finish(piece, recorded[piece.path])
                received.append(piece.path)
                current = None
    finally:
        if current is not None:
            current.handle.close()
    missing = sorted(set(recorded) - set(received))
    if current is not None or missing:
        raise DownloadError(f"the download ended early; missing {missing}")


def _safe_relative(path: str) -> Path:
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or ".." in relative.parts or "\\" in path:
        raise DownloadError(f"the server sent an unsafe file path {path!r}")
    return Path(*relative.parts)
