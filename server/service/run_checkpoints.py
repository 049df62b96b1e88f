"""A run's checkpoints as the service sees them: the journal entry each one carries, which one is
the latest intact one, and retention.

A SaveState checkpoint carries its own journal entry in its ``extra`` (``checkpoint_extra``):
the run, its position, the key and payload digest of the SaveState that wrote it, and that
operation's result. Recovery (``recovery``) restores the latest one and aligns the journal with it.

A checkpoint is trusted only once verified (``session.checkpoint.verify_checkpoint``: its files
load and hash to the digest it was written with), so one damaged latest checkpoint costs the
operations since the newest intact one (the controller replays them), never the whole run.
Verifying reads the chosen checkpoint once more than the restore does; a restart is rare, and a
restore of other bits than the journal recorded is worse.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract.files import TMP_MARK, atomic_directory, fsync_directory, fsync_path
from trainwire.server.engine.session.checkpoint import read_extra, verify_checkpoint
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.server.service.journal import JournalEntry
from trainwire.server.service.state_dir import RUN_CLOSED, RunDirectory, RunSpec

logger = logging.getLogger(__name__)

SERVER_EXTRA_KEY = "server"  # the checkpoint extra's key the server owns; others stay untouched


def written_by(path: Path, entry: JournalEntry) -> bool:
    """Whether the checkpoint at ``path`` is the one ``entry``'s SaveState wrote (it is visible
    to recovery, whatever failed after its rename)."""
    try:
        server = read_extra(path).get(SERVER_EXTRA_KEY)
    except (NotFound, InvalidArgument, OSError):
        return False
    return isinstance(server, dict) and (server.get("operation_key"), server.get("position")) == (
        entry.operation_key,
        entry.position,
    )


def checkpoint_extra(run_id: str, entry: JournalEntry) -> dict[str, Any]:
    """The ``extra`` a SaveState checkpoint is written with: ``entry``, the SaveState's own."""
    return {
        SERVER_EXTRA_KEY: {
            "run_id": run_id,
            "position": entry.position,
            "operation_key": entry.operation_key,
            "payload_sha256": entry.payload_sha256,
            "result": entry.result,
        }
    }


@dataclass(frozen=True)
class RestorePoint:
    """A checkpoint of this run and what its SaveState recorded (``position``, ``operation_key``,
    ``payload_sha256``, ``result``)."""

    path: Path
    server: dict[str, Any]
    skipped: tuple[str, ...] = ()  # newer checkpoints passed over as damaged

    @property
    def position(self) -> int:
        return int(self.server["position"])

    def entry(self, kind: str) -> JournalEntry:
        """The journal entry of the SaveState (journaled as ``kind``) that wrote this checkpoint."""
        server = self.server
        return JournalEntry(
            server["operation_key"], kind, server["payload_sha256"], self.position, server["result"]
        )


def latest_checkpoint(
    run: RunDirectory, run_id: str, *, damaged: list[str] | None = None
) -> RestorePoint | None:
    """The run's newest intact checkpoint: the highest position whose files verify.

    Checkpoints of other runs are skipped. A damaged one (a truncated file, bits that no longer
    hash to its recorded digest) is passed over for the next older one, with a warning, and
    left on disk for a look; the returned point lists what it passed over in ``skipped``, and
    so does ``damaged`` (when given), also when none is left to restore.
    """
    candidates = []
    for path in run.checkpoint_paths():
        try:
            server = read_extra(path).get(SERVER_EXTRA_KEY)
        except (NotFound, InvalidArgument) as error:
            logger.warning("ignoring checkpoint %s: %s", path.name, error)
            continue
        if not isinstance(server, dict) or server.get("run_id") != run_id:
            logger.warning("ignoring checkpoint %s: not a checkpoint of run %s", path.name, run_id)
            continue
        candidates.append(RestorePoint(path, server))
    skipped: list[str] = []
    # Newest first; at one position (never two, but a tampered directory) the first name wins.
    for point in sorted(candidates, key=lambda p: -p.position):
        try:
            verify_checkpoint(point.path)
        except (NotFound, InvalidArgument) as error:
            logger.error(
                "checkpoint %s is damaged (%s); trying an older one", point.path.name, error
            )
            skipped.append(point.path.name)
            continue
        if skipped:
            logger.warning(
                "restored %s instead of the damaged %s: the journal rolls back to its position %d",
                point.path.name,
                ", ".join(skipped),
                point.position,
            )
        if damaged is not None:
            damaged.extend(skipped)
        return dataclasses.replace(point, skipped=tuple(skipped))
    if skipped:
        logger.error("every checkpoint is damaged (%s): starting from the beginning", skipped)
    if damaged is not None:
        damaged.extend(skipped)
    return None


def restore_points(run: RunDirectory, run_id: str) -> list[RestorePoint]:
    """Every checkpoint folder of ``run`` that run ``run_id`` wrote (by its recorded entry);
    unreadable folders and other runs' are left out."""
    points = []
    for path in run.checkpoint_paths():
        try:
            server = read_extra(path).get(SERVER_EXTRA_KEY)
        except (NotFound, InvalidArgument):
            continue
        if isinstance(server, dict) and server.get("run_id") == run_id:
            points.append(RestorePoint(path, server))
    return points


def prune_checkpoints(
    run: RunDirectory,
    run_id: str,
    keep: int,
    protected: set[str],
    *,
    read_elsewhere: Callable[[str], bool] = lambda name: False,
) -> list[str]:
    """Remove this run's checkpoints beyond the ``keep`` newest (by recorded position), sparing
    ``protected`` names and those ``read_elsewhere`` (another run's replay reads them); returns
    the names removed.

    Right after a SaveState nothing journaled comes after the newest checkpoint, so no replay
    of this run needs an older one; older intact ones are only the fallback for a damaged newest
    (keep 2 or more for that). Another run that loaded an older one replays that load until it
    saves a checkpoint of its own, so that one stays until then. Other runs' checkpoints and
    unreadable folders are left alone.
    """
    removed = []
    for point in sorted(restore_points(run, run_id), key=lambda p: -p.position)[keep:]:
        if point.path.name not in protected and not read_elsewhere(point.path.name):
            shutil.rmtree(point.path)
            removed.append(point.path.name)
    if removed:
        logger.info("retention: removed checkpoints %s (keeping the %d newest)", removed, keep)
    return removed


def discard_saved(
    run: RunDirectory, run_id: str, checkpoints: list[str], exports: list[str], *, is_open: bool
) -> list[str]:
    """Remove run ``run_id``'s ``checkpoints`` and ``exports`` (a missing one is no error);
    returns the checkpoints kept for now.

    The open run's newest checkpoint is its recovery point (a restart restores it, and what was
    applied before it is no longer replayable), so it stays until a newer one supersedes it;
    the caller asks again then.
    """
    points = restore_points(run, run_id) if is_open else []
    newest = max(points, key=lambda p: p.position).path.name if points else None
    kept = []
    for name in checkpoints:
        if name == newest:
            kept.append(name)
        else:
            shutil.rmtree(run.checkpoint(name), ignore_errors=True)
    for name in exports:
        shutil.rmtree(run.export(name), ignore_errors=True)
    return kept


def copy_into_run(
    source: RunDirectory, run: RunDirectory, spec: RunSpec, folder: str, name: str | None
) -> None:
    """Make ``run`` a closed run (``spec``) holding ``source``'s checkpoint (``folder``
    "checkpoints") or export ("exports") ``name``; ``name`` None: a closed run of no files.

    A new run appears whole or not at all: it is built in a hidden folder beside the runs and
    renamed into place (``atomic_directory``; a crash leaves only the hidden folder, which the
    next start removes), so a copy that fails leaves no run behind. A run already there (a
    retry's) is finished instead; an open run is refused."""
    if run.exists():
        if run.read_spec().state != RUN_CLOSED:
            raise FailedPrecondition(f"run {spec.run_id!r} is open on this server")
        if name is not None:
            copy_saved(source, run, folder, name)
        return
    with atomic_directory(run.path) as staging:
        built = RunDirectory(staging)
        for made in (built.checkpoints, built.exports):
            made.mkdir()
        if name is not None:
            copy_saved(source, built, folder, name)
        built.write_spec(dataclasses.replace(spec, state=RUN_CLOSED))


def discard_run(run: RunDirectory) -> None:
    """Remove closed run ``run`` whole (a copy nobody was answered with). It leaves its place
    in one rename, so a crash midway leaves a hidden folder the next start removes, never a
    half run; an open run is refused."""
    if not run.exists():
        return
    if run.read_spec().state != RUN_CLOSED:
        raise FailedPrecondition(f"run {run.path.name!r} is open on this server")
    aside = run.path.with_name(f".{run.path.name}{TMP_MARK}discarded")
    shutil.rmtree(aside, ignore_errors=True)
    run.path.rename(aside)
    fsync_directory(run.path.parent)
    shutil.rmtree(aside)


def copy_saved(source: RunDirectory, target: RunDirectory, folder: str, name: str) -> None:
    """Copy ``source``'s checkpoint (``folder`` "checkpoints") or export ("exports") ``name``
    into ``target`` under the same name, sharing the files' storage (hard links; a copy where
    the file system has none), written whole or not at all (a hidden folder renamed into
    place). A copy already there is left as it is: copying again (a retry) changes nothing.
    Saved folders are never written again once in place, so sharing their files is safe."""
    place = target.checkpoint if folder == "checkpoints" else target.export
    origin = source.checkpoint(name) if folder == "checkpoints" else source.export(name)
    destination = place(name)
    if destination.is_dir():
        return
    if not origin.is_dir():
        raise NotFound(f"{folder[:-1]} {name!r} of this run is no longer on disk")
    partial_copy = destination.with_name(f".{name}{TMP_MARK}copy")
    shutil.rmtree(partial_copy, ignore_errors=True)
    shutil.copytree(origin, partial_copy, copy_function=link_or_copy)
    for folder_path, _, files in os.walk(partial_copy):  # durable before it is in place
        for file in files:
            fsync_path(Path(folder_path) / file)
        fsync_directory(Path(folder_path))
    partial_copy.rename(destination)
    fsync_directory(destination.parent)


def link_or_copy(origin: str, destination: str) -> None:
    """``shutil.copytree``'s copy function for saved files: a hard link, so the copy shares
    the file's storage (a copy where the file system has no links)."""
    try:
        os.link(origin, destination)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(origin, destination)
