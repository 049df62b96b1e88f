"""The server's state directory: where each run keeps its spec, checkpoints and exports, beside
the one ledger of every run's journal and the Tinker front's requests.

The layout (names are the constants below)::

    <state dir>/
      server.lock              held (flock) by the one server using the directory
      ledger.sqlite3           the ledger (``ledger``: WAL, so also -wal and -shm beside it,
                               and its ``.created`` marker)
      runs/<run_id>/
        run.json               the RunSpec: run id, config and fingerprints, max_steps, plan,
                               open | closed
        checkpoints/<name>/    session checkpoints written by SaveState
        exports/<name>/        inference exports written by ExportWeights

Each run's files stay apart, so a closed run's checkpoints (and its rows of the ledger) survive
the next run. Run ids, checkpoint and export names match
``[A-Za-z0-9][A-Za-z0-9._-]{0,127}`` and must resolve inside their folder
(``trainwire.server.paths``), so neither ``..`` nor a planted symlink leads out of the state
directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainwire.contract.files import clean_leftovers, write_text_atomic
from trainwire.contract.outcomes import ExportedFile
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.server.paths import links_under, resolve_inside, symlink_between

logger = logging.getLogger(__name__)

RUNS_DIR = "runs"
LOCK_FILE = "server.lock"
RUN_FILE = "run.json"
CHECKPOINTS_DIR = "checkpoints"
EXPORTS_DIR = "exports"
RUN_OPEN, RUN_CLOSED = "open", "closed"

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"


def check_name(name: str, what: str) -> str:
    """``name`` if it is a valid run, checkpoint or export name; InvalidArgument otherwise."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(f"{what} name {name!r} is not allowed: use {NAME_RULE}")
    return name


def confined(root: Path, folder: Path, name: str, what: str, *, whole: bool = False) -> Path:
    """``folder/name`` after checking the name and the path against the real state ``root``.

    No folder from ``root`` down to ``folder`` may be a symlink (a tampered state directory,
    FAILED_PRECONDITION), nor ``folder/name`` itself (INVALID_ARGUMENT, as a bad name is); with
    ``whole``, nothing inside it either (checkpoints and exports are read file by file).
    """
    check_name(name, what)
    refuse_links_on_the_way(root, folder)
    path = folder / name
    if path.is_symlink():
        escapes = resolve_inside(folder, name) in (None, folder.resolve())
        where = "resolves outside its folder" if escapes else "is a symbolic link"
        raise InvalidArgument(
            f"{what} {name!r} {where} (a symlink?); the state directory holds none, refused"
        )
    if whole and path.is_dir():
        refuse_links_inside(path, f"{what} {name!r}")
    return path


def refuse_links_on_the_way(root: Path, folder: Path) -> None:
    """FAILED_PRECONDITION when a folder of the state directory was swapped for a symlink."""
    link = symlink_between(root, folder)
    if link is not None:
        raise FailedPrecondition(
            f"the state directory was tampered with: {link.relative_to(root)} is a symbolic "
            "link, and the server reads and writes nothing through one. Put the real directory "
            "back (or start the server on a clean state directory)"
        )


def refuse_links_inside(directory: Path, what: str) -> None:
    """FAILED_PRECONDITION when a checkpoint or export holds a symlink (it never does)."""
    links = links_under(directory)
    if links:
        raise FailedPrecondition(
            f"{what} holds a symbolic link ({links[0].relative_to(directory)}), which the "
            "server never writes: refused. Remove the link, or save (export) it again"
        )


@dataclass(frozen=True)
class RunSpec:
    """What identifies a run's session (``run.json``), kept so a restarted server can reopen it."""

    run_id: str
    config: dict[str, Any]
    config_fingerprint: str
    max_steps: int | None
    plan_fingerprint: str
    state: str = RUN_OPEN

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def differences(self, requested: RunSpec) -> list[str]:
        """How ``requested`` differs from this run in config, max_steps and plan, in words."""
        out = []
        if self.config_fingerprint != requested.config_fingerprint:
            ours, theirs = self.config, requested.config
            changes = ", ".join(
                f"{key}: open {ours.get(key)!r}, requested {theirs.get(key)!r}"
                for key in sorted(set(ours) | set(theirs))
                if ours.get(key) != theirs.get(key)
            )
            out.append(f"config ({changes})")
        # A request that names no max_steps or plan (a plain open(run_id, config)) accepts the
        # open run's; one that names them must match.
        if requested.max_steps is not None and self.max_steps != requested.max_steps:
            out.append(f"max_steps (open {self.max_steps}, requested {requested.max_steps})")
        if requested.plan_fingerprint and self.plan_fingerprint != requested.plan_fingerprint:
            out.append(
                f"plan fingerprint (open {self.plan_fingerprint!r}, "
                f"requested {requested.plan_fingerprint!r})"
            )
        return out

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


class RunDirectory:
    """One run's folder under ``<state dir>/runs``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checkpoints = path / CHECKPOINTS_DIR
        self.exports = path / EXPORTS_DIR

    def exists(self) -> bool:
        return (self.path / RUN_FILE).is_file()

    def read_spec(self) -> RunSpec:
        return RunSpec.from_json((self.path / RUN_FILE).read_text())

    def write_spec(self, spec: RunSpec) -> None:
        for folder in (self.path, self.checkpoints, self.exports):
            folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path / RUN_FILE, spec.to_json())

    @property
    def root(self) -> Path:
        """The state directory this run lives in (``<root>/runs/<run_id>``)."""
        return self.path.parents[1]

    def checkpoint(self, name: str) -> Path:
        return confined(self.root, self.checkpoints, name, "checkpoint", whole=True)

    def export(self, name: str) -> Path:
        return confined(self.root, self.exports, name, "export", whole=True)

    def checkpoint_paths(self) -> list[Path]:
        """Every finished checkpoint folder (hidden temporary folders excluded), by name.

        A symlink, or a folder holding one, is skipped with a warning: recovery reads nothing
        through a link.
        """
        refuse_links_on_the_way(self.root, self.checkpoints)
        if not self.checkpoints.is_dir():
            return []
        paths = []
        for path in sorted(self.checkpoints.iterdir()):
            if not NAME_PATTERN.fullmatch(path.name) or not path.is_dir():
                continue
            if path.is_symlink() or links_under(path):
                logger.warning("ignoring checkpoint %s: it is or holds a symbolic link", path.name)
                continue
            paths.append(path)
        return paths


def sibling_run(run: RunDirectory, run_id: str) -> RunDirectory:
    """Run ``run_id``'s folder beside ``run``, confined like ``StateDirectory.run``; NotFound
    when no such run was ever opened here."""
    root = run.root
    other = RunDirectory(confined(root, root / RUNS_DIR, run_id, "run id"))
    if not other.exists():
        raise NotFound(f"no run {run_id!r} on this server")
    return other


class StateDirectory:
    """The root every run lives under; created on first use, and held by one server at a time.

    The hold is an exclusive ``flock`` on ``server.lock``: the kernel drops it when the process
    dies, so a restarted server takes over at once, while a second live one is refused.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        (self.root / RUNS_DIR).mkdir(parents=True, exist_ok=True)
        if (self.root / RUNS_DIR).is_symlink():
            raise OSError(
                f"{self.root / RUNS_DIR} is a symbolic link; give --state-dir the real directory"
            )
        self._lock_fd: int | None = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise OSError(
                f"another server is using the state directory {self.root}; stop it first"
            ) from None
        self._clean_leftovers()

    def _clean_leftovers(self) -> None:
        """Finish or remove what interrupted checkpoint and export writes left behind, before
        recovery lists the checkpoints (a replacement cut short may have left the old one
        hidden), and runs a copy was building or removing when it stopped (hidden beside
        the runs: a run appears and leaves in one rename)."""
        for action in clean_leftovers(self.root / RUNS_DIR):
            logger.warning("%s: %s", RUNS_DIR, action)
        for run_path in sorted((self.root / RUNS_DIR).iterdir()):
            for folder in (run_path / CHECKPOINTS_DIR, run_path / EXPORTS_DIR):
                if run_path.is_symlink() or folder.is_symlink() or not folder.is_dir():
                    continue  # never follow a planted link out of the state directory
                for action in clean_leftovers(folder):
                    logger.warning("%s: %s", folder.relative_to(self.root), action)

    def release(self) -> None:
        """Let another server take the directory over."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    def run(self, run_id: str) -> RunDirectory:
        """Run ``run_id``'s folder; FAILED_PRECONDITION if it (or its spec or folders)
        was swapped for a symlink, which would take the server's writes elsewhere."""
        path = confined(self.root, self.root / RUNS_DIR, run_id, "run id")
        if path.is_dir():
            for entry in sorted(path.iterdir()):
                refuse_links_on_the_way(self.root, entry)
        return RunDirectory(path)

    def open_runs(self) -> list[RunSpec]:
        """The runs recorded as open (at most one, unless the directory was tampered with)."""
        specs = []
        for path in sorted((self.root / RUNS_DIR).iterdir()):
            run = RunDirectory(path)
            if NAME_PATTERN.fullmatch(path.name) and not path.is_symlink() and run.exists():
                spec = run.read_spec()
                if spec.state == RUN_OPEN:
                    specs.append(spec)
        return specs


CHUNK_BYTES = 1 << 20  # the most a streamed chunk carries


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def list_export_files(directory: Path) -> tuple[ExportedFile, ...]:
    """Every file of an export, sorted by its ``/``-separated relative path, with its sha256.

    A symlink inside is refused: its target's bytes (or size and digest) must never be sent.
    """
    refuse_links_inside(directory, f"export {directory.name!r}")
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return tuple(
        ExportedFile(p.relative_to(directory).as_posix(), p.stat().st_size, _sha256_of(p))
        for p in sorted(files, key=lambda p: p.relative_to(directory).as_posix())
    )


def read_export_files(
    directory: Path, files: Iterable[ExportedFile], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[ExportedFile, int, memoryview]]:
    """Each file's ``(file, offset, data)`` chunks in order, then ``(file, size, empty)``.

    ``data`` views one reused buffer (no fresh allocation per chunk): it is valid until the next
    item. The bytes are read as they are now; the receiver checks them against the recorded
    sha256.
    """
    buffer = memoryview(bytearray(chunk_bytes))
    for file in files:
        offset = 0
        with open(confined_file(directory, file.path), "rb", buffering=0) as handle:
            while read := handle.readinto(buffer):
                yield file, offset, buffer[:read]
                offset += read
        yield file, offset, buffer[:0]


def confined_file(directory: Path, relative: str) -> Path:
    """``directory/relative`` for a recorded export path, refusing anything that leaves it."""
    base = directory.resolve()
    path = None if PurePosixPath(relative).is_absolute() else resolve_inside(base, relative)
    if path is None or path == base or symlink_between(base, base / relative) is not None:
        raise InvalidArgument(
            f"export file {relative!r} lies outside export {directory.name!r} (or is a link)"
        )
    return path


def refuse_another_run(current: RunSpec, requested: RunSpec) -> None:
    """FAILED_PRECONDITION naming every way ``requested`` differs from the open run."""
    if current.run_id != requested.run_id:
        raise FailedPrecondition(
            f"the server's session is open for run {current.run_id!r}, not {requested.run_id!r}; "
            f"close it first (trainwire close --server HOST:PORT --run-id {current.run_id}) or "
            "use another server"
        )
    differences = current.differences(requested)
    if differences:
        raise FailedPrecondition(
            f"run {current.run_id!r} is open with another {'; another '.join(differences)}. "
            "Use a new run id for a new configuration"
        )
