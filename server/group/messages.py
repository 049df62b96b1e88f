"""What rank 0 sends the other ranks besides engine calls (``lockstep.Call``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainwire.contract.config import TrainingConfig


@dataclass(frozen=True)
class OpenSession:
    """Build the session rank 0 is building (each rank on its own device); the previous one,
    if any, is dropped first."""

    config: TrainingConfig
    max_steps: int | None
    model_root: Path | None


@dataclass(frozen=True)
class Stop:
    """The server stopped cleanly: leave the group and exit 0."""
