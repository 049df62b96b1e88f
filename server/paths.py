"""Path confinement, written once: a name given relative to a folder must resolve inside it.

Symlinks are resolved before the check, so neither ``..`` nor a planted link leads out. The state
directory (run ids, checkpoints, exports, export files) and the model root both check here, each
against its real (resolved) root, never against a folder that might itself be a link. The state
directory holds no symlinks at all (``symlink_between``, ``links_under``); a model directory may
(a Hugging Face cache links its snapshots to blobs), as long as every link stays in the model
root (``links_leaving``).
"""

from __future__ import annotations

import os
from pathlib import Path


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
