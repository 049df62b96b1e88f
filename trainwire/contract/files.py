"""Atomic file writes (a reader sees the old file or the new one, never half of either), and
reading PEM material given as bytes or as a path."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
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


RENAME_EXCHANGE = 2  # renameat2(2): swap two existing paths in one step
_AT_FDCWD = -100
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV)
TMP_MARK, OLD_MARK = ".tmp-", ".old-"  # hidden ``.<name><mark><random>`` beside ``<name>``
_LEFTOVER = re.compile(r"\.(?P<name>.+)(?P<mark>\.tmp-|\.old-)[a-z0-9_]+")


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or the filesystem cannot, so the caller falls back to two renames."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, f"cannot swap {b.name} with its replacement: {os.strerror(code)}")


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` whole.

    Everything in it is fsynced, then it takes the name in one step and the parent is fsynced:
    a rename when ``path`` is new, an atomic exchange with the old directory when it exists, so
    a reader (or a restart) finds the old directory or the new one there, never neither and
    never a mix. Where the filesystem cannot exchange, the old directory is moved aside to
    ``.<name>.old-*`` first and put back if the second rename fails; a crash between the two
    renames leaves it aside, and ``clean_leftovers`` (run before anything reads the folder)
    puts it back. On an error before the swap, ``path`` is untouched and the temporary is gone.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_MARK}", dir=target.parent))
    try:
        yield tmp
        for item in sorted(tmp.rglob("*"), reverse=True):  # files before their folders
            fsync_path(item)
        fsync_path(tmp)
        if os.path.lexists(target):
            _replace_existing(tmp, target)  # the old directory ends up at ``tmp``
        else:
            os.replace(tmp, target)
        fsync_directory(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_existing(new: Path, target: Path) -> None:
    if exchange_paths(new, target):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}{OLD_MARK}", dir=target.parent))
    os.replace(target, aside / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside / target.name, target)
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def clean_leftovers(folder: Path) -> list[str]:
    """Finish what interrupted ``atomic_directory`` calls left in ``folder``; what was done.

    A hidden ``.<name>.old-*`` whose ``<name>`` is missing holds the only copy (a replacement
    died between its two renames): it is put back. Every other leftover (unfinished writes, old
    copies whose replacement landed) is removed. Call it only while nothing writes there (at
    server start, before recovery reads the folder).
    """
    done = []
    for entry in sorted(folder.iterdir()):
        match = _LEFTOVER.fullmatch(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        name = match["name"]
        hidden = entry / name
        if match["mark"] == OLD_MARK and not os.path.lexists(folder / name) and hidden.is_dir():
            os.replace(hidden, folder / name)
            done.append(f"put back {name} from {entry.name}")
        else:
            done.append(f"removed {entry.name}")
        shutil.rmtree(entry, ignore_errors=True)
    if done:
        fsync_directory(folder)
    return done


Pem = bytes | str | os.PathLike[str]  # PEM bytes, or a path to a PEM file


def read_pem(value: Pem | None) -> bytes | None:
    """PEM bytes as given, or read from the file a path names (None stays None).

    TLS options on both sides take either, so a certificate can come from memory or disk.
    """
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()
