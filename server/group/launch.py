"""Which rank this process is, as its launcher says through the environment (torch-free).

``trainwire serve`` reads it before torch is imported, so a launch that cannot work (a missing
variable, an ``--nproc`` that disagrees with the launcher's world) is refused in a moment rather
than after the seconds torch takes to load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process's place in the group, as its launcher set it."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> Launch | None:
        """None when no launcher started this process (a plain ``trainwire serve``; a lone
        ``WORLD_SIZE=1``, which some environments set, is no launcher either)."""
        if "RANK" not in environ and environ.get("WORLD_SIZE", "").strip() in ("", "1"):
            return None
        missing = [name for name in LAUNCH_VARIABLES if not environ.get(name)]
        if missing:
            raise ValueError(
                f"a launcher set RANK/WORLD_SIZE but not {', '.join(missing)}; start the ranks "
                "with torchrun or trainwire serve --nproc N"
            )
        try:
            launch = cls(
                int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"])
            )
        except ValueError as error:
            raise ValueError(
                f"RANK, WORLD_SIZE and LOCAL_RANK must be integers ({error})"
            ) from None
        if not 0 <= launch.rank < launch.world_size or launch.local_rank < 0:
            raise ValueError(f"RANK {launch.rank} is outside WORLD_SIZE {launch.world_size}")
        return launch

    @property
    def leads(self) -> bool:
        """Rank 0 serves: listeners, journal, state directory, recovery."""
        return self.rank == 0
