"""Rank 0's announcements to the other ranks, in order: one broadcast of a pickled message each.

The messages are small (an engine call's name and arguments: a batch of examples at most, which
the service has already bounded), and a broadcast on the control group delivers them to every
rank in the order rank 0 sent them.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

LEADER_RANK = 0


class BroadcastChannel:
    """``send`` on rank 0, ``receive`` on every other rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=LEADER_RANK, group=self._group)

    def receive(self) -> Any:
        """Block until rank 0's next message (a RuntimeError if rank 0 is gone)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=LEADER_RANK, group=self._group)
        return box[0]
