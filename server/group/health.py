"""Rank 0's health while another rank may be stalled, and the group's ready mark.

The session host says SERVING when it can take operations. In a group that is not enough: an
operation also needs every other rank, and one that has stopped making progress would leave it
waiting in a collective. So rank 0 reads the other ranks' heartbeats on the board (``board``)
and holds health at NOT_SERVING while any has been silent for half the stall bound; the
supervisor takes the group down at the whole bound, and the restarted group serves again once
it has recovered. A rank heard of again before that (a pause, not a stall) gives health back.

The host's first SERVING is also the group's ready mark: the supervisor counts a group as having
lived only from then, so one that fails every time while it starts is given up, however long
its start takes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from trainwire.server.group.board import GroupBoard, Silence
from trainwire.server.group.heartbeat import beat_interval_s

logger = logging.getLogger(__name__)

SetServing = Callable[[bool], None]


class GroupHealth:
    """Gates rank 0's health signal on the other ranks' heartbeats (``gate``)."""

    def __init__(self, board: GroupBoard, stall_timeout_s: float) -> None:
        self._board = board
        self._suspect_s = stall_timeout_s / 2
        self._interval = beat_interval_s(stall_timeout_s)
        self._silence = Silence(board)
        self._lock = threading.Lock()
        self._set_serving: SetServing | None = None
        self._host_serving = False
        self._silent: int | None = None  # the rank held against health, if any

    def gate(self, set_serving: SetServing) -> SetServing:
        """The host's health signal in, the group's out (to ``set_serving``); starts the watch."""
        self._set_serving = set_serving
        if self._board.world_size == 1:
            return self._host  # no other rank to hear from
        threading.Thread(target=self._watch, name="trainwire-group-health", daemon=True).start()
        return self._host

    def _host(self, serving: bool) -> None:
        with self._lock:
            self._host_serving = serving
            if serving:
                self._board.mark_ready()
            self._publish()

    def _watch(self) -> None:
        others = range(1, self._board.world_size)
        while True:
            self._silence.update()
            rank, silent_s = self._silence.longest(others)
            silent = rank if silent_s > self._suspect_s else None
            with self._lock:
                if silent != self._silent:
                    self._report(silent, rank, silent_s)
                    self._silent = silent
                    self._publish()
            time.sleep(self._interval)

    def _report(self, silent: int | None, rank: int, silent_s: float) -> None:
        if silent is not None:
            logger.error(
                "rank %d has not been heard of for %.1f s: health is NOT_SERVING until it is, "
                "or until the supervisor restarts the group",
                rank,
                silent_s,
            )
        else:
            logger.warning("rank %d is heard of again", self._silent)

    def _publish(self) -> None:
        assert self._set_serving is not None
        self._set_serving(self._host_serving and self._silent is None)
