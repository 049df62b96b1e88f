"""Path confinement, written once: a name given relative to a folder must resolve inside it.

Symlinks are resolved before the check, so neither ``..`` nor a planted link leads out. The state
directory (run ids, checkpoints, exports, export files) and the model root both check here, each
against its real (resolved) root, never against a folder that might itself be a link. The state
directory holds no symlinks at all (``symlink_between``, ``links_under``); a model directory may
(a Hugging Face cache links its snapshots to blobs), as long as every link stays in the model
root (``links_leaving``). ``resolve_under`` is the model root's check, with the messages a
caller sees.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainwire.server.errors import InvalidArgument


def resolve_inside(base: Path, relative: str) -> Path | None:
    """``base / relative`` with every symlink resolved, or None when that is not ``base`` or a
    path under it (an absolute ``relative`` counts by where it points)."""
    root = base.resolve()
    path = (root / relative).resolve()
    return path if is_within(root, path) else None


def is_within(root: Path, path: Path) -> bool:
    """``path`` is ``root`` or below it (both already resolved)."""
    return path == root or root in path.parents


def symlink_between(root: Path, path: Path) -> Path | None:
    """The first of ``path``'s components below ``root`` that is a symbolic link, or None.

    ``path`` is ``root / <relative parts>`` written out, not resolved: this is how a folder that
    was swapped for a link after the server made it is found.
    """
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            return current
        if not current.exists():
            return None
    return None


def links_under(directory: Path) -> list[Path]:
    """Every symbolic link inside ``directory`` (links to folders are listed, not entered)."""
    found = []
    for folder, subfolders, files in os.walk(directory):  # followlinks=False
        for name in (*subfolders, *files):
            path = Path(folder, name)
            if path.is_symlink():
                found.append(path)
    return sorted(found)


def links_leaving(root: Path, directory: Path) -> list[Path]:
    """The links inside ``directory`` that resolve outside the real ``root``."""
    real_root = root.resolve()
    return [link for link in links_under(directory) if not is_within(real_root, link.resolve())]


def resolve_under(root: Path | None, name: str, what: str) -> Path:
    """``name`` as a path inside ``root`` (any local path when there is no root).

    Symlinks are resolved first (``paths.resolve_inside``), so a link cannot lead outside the
    root either, and nor can a link inside the directory: every one must stay in the real root
    (a Hugging Face cache's snapshot-to-blob links do). Messages name paths as the caller gave
    them, never where the server keeps them.
    """
    if not name:
        raise InvalidArgument(f"{what}: empty path")
    try:
        return _confined_model_path(root, name, what)
    except (OSError, ValueError) as error:  # too long, a NUL byte, a loop of links
        if isinstance(error, InvalidArgument):
            raise
        reason = getattr(error, "strerror", None) or str(error)
        raise InvalidArgument(f"{what} {name[:100]!r} is not a usable path ({reason})") from None


def _confined_model_path(root: Path | None, name: str, what: str) -> Path:
    if root is None:
        return Path(name).expanduser().resolve()
    candidate = resolve_inside(root, name)
    if candidate is None:
        raise InvalidArgument(f"{what} {name[:100]!r} resolves outside the model root; refused")
    if candidate.is_dir():
        leaving = links_leaving(root, candidate)
        if leaving:
            raise InvalidArgument(
                f"{what} {name!r}: {leaving[0].relative_to(candidate)} links outside the model "
                "root; refused. Copy the file into the model root instead of linking it"
            )
    return candidate
