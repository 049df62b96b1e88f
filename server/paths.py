"""Path confinement, written once: a name given relative to a folder must resolve inside it.

Symlinks are resolved before the check, so neither ``..`` nor a planted link leads out. The state
directory (run ids, checkpoints, exports, export files) and the model root both check here.
"""

from __future__ import annotations

from pathlib import Path


def resolve_inside(base: Path, relative: str) -> Path | None:
    """``base / relative`` with every symlink resolved, or None when that is not ``base`` or a
    path under it (an absolute ``relative`` counts by where it points)."""
    root = base.resolve()
    path = (root / relative).resolve()
    return path if path == root or root in path.parents else None
