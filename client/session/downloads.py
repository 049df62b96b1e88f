"""Receiving an export stream: files written into a staging directory, every byte checked
against the sizes and sha256 the server recorded, the directory swapped in only when all match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from trainwire.contract import chunks, codec, outcomes
from trainwire.contract.files import atomic_directory
from trainwire.v1 import session_pb2 as pb


class DownloadError(RuntimeError):
    """Downloaded export files do not match what the server recorded; nothing was kept."""


ExportItem = pb.ExportWeightsResponse | chunks.RawChunk


def check_download_target(download_to: str | Path, *, replace: bool = False) -> Path:
    """``download_to`` as a path, if a download may go there: missing, an empty directory, or
    (with ``replace``) a directory whose contents the download replaces whole.

    Call it before asking the server for the files, so a refusal costs no transfer.
    """
    target = Path(download_to)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"download_to {str(target)!r} exists and is not a directory")
    if not replace and target.is_dir() and any(target.iterdir()):
        raise FileExistsError(
            f"download_to {str(target)!r} is not empty; pass replace=True to replace its "
            "contents with the export, or name an empty or new directory"
        )
    return target


def receive_export(
    stream: Iterator[ExportItem], download_to: str | Path | None, *, replace: bool = False
) -> outcomes.ExportOutcome:
    """The export's outcome from ``stream``; with ``download_to``, its files land there once
    every one checked out (``replace``: a non-empty ``download_to`` may be replaced)."""
    if download_to is not None:
        check_download_target(download_to, replace=replace)
    first = next(stream)
    if isinstance(first, chunks.RawChunk) or first.WhichOneof("item") != "result":
        raise DownloadError("the export stream did not start with its result")
    outcome = codec.export_outcome_from_proto(first.result)
    if download_to is None:
        return outcome
    target = Path(download_to)
    with atomic_directory(target) as staging:
        _receive_files(stream, staging, outcome.files)
    return dataclasses.replace(outcome, directory=target)


class _IncomingFile:
    """One file being received: written to staging, hashed, and held to its recorded size."""

    def __init__(self, staging: Path, recorded: outcomes.ExportedFile) -> None:
        self.path = recorded.path
        self.limit = recorded.size_bytes
        self.local = staging / _safe_relative(self.path)
        self.local.parent.mkdir(parents=True, exist_ok=True)
        self.handle: BinaryIO = open(self.local, "wb")  # noqa: SIM115 (closed by finish)
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, offset: int, data: memoryview) -> None:
        if offset != self.size:
            raise DownloadError(f"{self.path}: chunk at offset {offset}, expected {self.size}")
        if self.size + len(data) > self.limit:
            # Checked before writing: a server cannot make the client write past the record.
            raise DownloadError(
                f"{self.path}: the server sent more than the {self.limit} bytes the export "
                "records; nothing was kept. Export it again"
            )
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
                if piece.path in received:
                    raise DownloadError(f"the server sent {piece.path} twice; export it again")
                current = _IncomingFile(staging, recorded[piece.path])
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
