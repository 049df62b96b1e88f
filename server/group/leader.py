"""Rank 0 of a served group: it builds each session on every rank and announces every call.

The session host builds its sessions through ``GroupLeader.open_session`` instead of
``TrainingSession`` directly; everything else on rank 0 is the single-process server unchanged.
The session it returns carries its own ``Announcer`` (sharing the leader's lock), so each of its
collective methods reaches every rank (``lockstep``); a session that is replaced has its announcer
retired, so nothing called on it reaches ranks that now hold the next one.

When the ranks may no longer be in step (a rank died, one rank ran out of memory, a call failed
in a way that is not a refusal every rank made), rank 0 exits at once with ``GROUP_LOST_EXIT``:
what a client was told is already in the journal, and what it was not told it sends again, so
restarting the whole group from the latest checkpoint and journal (the supervisor, torchrun or
the pod's controller does) is the same recovery as after a SIGKILL of a single-process server.
Answering the client instead would leave a group that cannot take another operation.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from trainwire.contract.config import TrainingConfig
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.sharded.lockstep import Announcer, raised_alike_on_every_rank
from trainwire.server.group.messages import OpenSession, Stop
from trainwire.server.group.ranks import RankGroup

logger = logging.getLogger(__name__)

GROUP_LOST_EXIT = 75  # EX_TEMPFAIL: restart the group and it recovers


def take_group_down(error: BaseException) -> None:
    """The ranks may be at different collectives: exit now, so the group restarts together."""
    logger.critical(
        "the session's ranks are out of step (%s: %s); exiting so the group restarts and "
        "recovers from its latest checkpoint and journal",
        type(error).__name__,
        error,
    )
    logging.shutdown()
    os._exit(GROUP_LOST_EXIT)  # no cleanup: threads blocked in collectives would never return


class GroupLeader:
    """Builds sessions on every rank of ``group`` and leads them."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self._lock = threading.RLock()  # shared by every session's announcer
        self._announcer: Announcer | None = None  # the newest session's

    def open_session(
        self,
        config: TrainingConfig,
        *,
        device: torch.device,
        max_steps: int | None,
        model_root: Path | None,
    ) -> TrainingSession:
        """``TrainingSession(...)`` on every rank, sharded over the group; a refusal (a bad
        config) is raised here and alike on the other ranks, which then hold no session."""
        with self._lock:
            if self._announcer is not None:
                self._announcer.retire("the session was replaced by another on this group")
            announcer = Announcer(self.group.channel, take_group_down, self._lock)
            self._announcer = announcer
            announcer.send(OpenSession(config, max_steps, model_root))
            try:
                session = TrainingSession(
                    config,
                    device=device,
                    max_steps=max_steps,
                    model_root=model_root,
                    process_group=self.group.world,
                )
            except BaseException as error:
                if not raised_alike_on_every_rank(error):
                    take_group_down(error)
                raise
            session.announcer = announcer
            return session

    def stop(self) -> None:
        """The server stopped cleanly: the other ranks exit too. A rank already gone (the
        launcher may stop them all at once) is no reason to fail a clean stop."""
        try:
            with self._lock:
                self.group.channel.send(Stop())
        except RuntimeError as error:
            logger.warning("could not tell every rank to stop (%s)", error)
