"""Atomic file writes (a reader sees the old file or the new one, never half of either), and
reading PEM material given as bytes or as a path."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (POSIX needs the directory itself synced)."""
    fsync_path(directory)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(path, text.encode())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` whole.

    Everything in it is fsynced, then it is renamed into place and the parent fsynced. An
    existing directory at ``path`` is moved aside first and removed after the rename, so a crash
    leaves the old directory or the new one under ``path`` (or the old one aside), never a mix.
    On an error the temporary directory is removed and ``path`` is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        for item in sorted(tmp.rglob("*"), reverse=True):  # files before their folders
            fsync_path(item)
        fsync_path(tmp)
        aside = None
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, aside / target.name)
        os.replace(tmp, target)
        fsync_directory(target.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


Pem = bytes | str | os.PathLike[str]  # PEM bytes, or a path to a PEM file


def read_pem(value: Pem | None) -> bytes | None:
    """PEM bytes as given, or read from the file a path names (None stays None).

    TLS options on both sides take either, so a certificate can come from memory or disk.
    """
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()
