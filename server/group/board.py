"""The group's board: one small shared file where each rank counts its heartbeats and rank 0
marks the group ready.

``trainwire serve --nproc N``'s supervisor creates a fresh board for each group it starts and
names it to the ranks (``BOARD_ENV``). A slot per rank holds that rank's heartbeat count, one
more slot holds rank 0's ready mark. Counts rather than timestamps: each reader times the
silence on its own clock (``Silence``), so no two processes' clocks are compared, and a read
torn by a concurrent write only looks like one more beat.

Readers: the supervisor (a rank silent past the stall bound takes the group down; a group is
counted as having lived only from when it became ready) and rank 0 (health NOT_SERVING while
another rank is silent, ``health``).
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable
from pathlib import Path

BOARD_ENV = "TRAINWIRE_GROUP_BOARD"  # the board's path, set by the supervisor for its ranks
_SLOT = struct.Struct("<Q")


class GroupBoard:
    """``world_size`` heartbeat counts and a ready mark, shared through one mapped file."""

    def __init__(self, path: Path, world_size: int) -> None:
        self.path = path
        self.world_size = world_size
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), self._size(world_size))

    @classmethod
    def create(cls, path: Path, world_size: int) -> GroupBoard:
        """A new board of zeros at ``path`` (the supervisor's, once per group)."""
        with open(path, "wb") as file:
            file.write(bytes(cls._size(world_size)))
        return cls(path, world_size)

    @staticmethod
    def _size(world_size: int) -> int:
        return _SLOT.size * (world_size + 1)

    def beat(self, rank: int) -> None:
        """One more heartbeat of ``rank`` (only that rank writes its slot)."""
        offset = _SLOT.size * rank
        (count,) = _SLOT.unpack_from(self._map, offset)
        _SLOT.pack_into(self._map, offset, count + 1)

    def beats(self) -> list[int]:
        """Every rank's heartbeat count, in rank order."""
        return [_SLOT.unpack_from(self._map, _SLOT.size * r)[0] for r in range(self.world_size)]

    def mark_ready(self) -> None:
        """Rank 0 serves: the group finished starting (recovery included)."""
        _SLOT.pack_into(self._map, _SLOT.size * self.world_size, 1)

    @property
    def ready(self) -> bool:
        return _SLOT.unpack_from(self._map, _SLOT.size * self.world_size)[0] != 0

    def close(self) -> None:
        self._map.close()

    def remove(self) -> None:
        """Close and delete the file (the supervisor's, once the group is gone)."""
        self.close()
        self.path.unlink(missing_ok=True)


class Silence:
    """How long each rank's heartbeat count has stood still, timed by this reader.

    A rank that has not beaten yet is timed from when the reader started watching, against
    ``first_beat_s``: a process starting up under load may take a while to run its first line.
    """

    def __init__(
        self,
        board: GroupBoard,
        *,
        first_beat_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._board = board
        self._clock = clock
        self._first_beat_s = first_beat_s
        now = clock()
        self._counts = [0] * board.world_size
        self._changed = [now] * board.world_size

    def update(self) -> None:
        """Read the board: a count that moved restarts its rank's silence."""
        now = self._clock()
        for rank, count in enumerate(self._board.beats()):
            if count != self._counts[rank]:
                self._counts[rank] = count
                self._changed[rank] = now

    def silent_for(self, rank: int) -> float:
        """Seconds since ``rank`` was last heard of, less the start-up allowance before its
        first beat."""
        silent = self._clock() - self._changed[rank]
        return silent if self._counts[rank] else silent - self._first_beat_s

    def longest(self, ranks: range | None = None) -> tuple[int, float]:
        """The rank (of ``ranks``, default all) silent longest, and for how long."""
        ranks = range(self._board.world_size) if ranks is None else ranks
        rank = max(ranks, key=self.silent_for)
        return rank, self.silent_for(rank)
