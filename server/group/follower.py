"""Every rank but 0: hold a shard of the session and make each call rank 0 announces.

The loop has no decisions of its own. It builds the session rank 0 builds (on this rank's
device), calls each method rank 0 calls with the same arguments, and throws the results away:
rank 0 answers the clients. A refusal is raised here exactly as on rank 0 (the same check on the
same arguments, or an outcome the ranks agreed on), so it is logged and the loop goes on. Any
other failure means this rank may no longer be in step: the process exits non-zero, which takes
the group down for a restart (``leader``).
"""

from __future__ import annotations

import gc
import logging

from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.sharded.lockstep import Call, raised_alike_on_every_rank
from trainwire.server.group.messages import OpenSession, Stop
from trainwire.server.group.ranks import RankGroup

logger = logging.getLogger(__name__)


def follow(group: RankGroup) -> None:
    """Follow rank 0 until it stops cleanly (returns) or is lost (raises)."""
    session: TrainingSession | None = None
    while True:
        message = group.channel.receive()
        if isinstance(message, Stop):
            return
        if isinstance(message, OpenSession):
            session = None
            gc.collect()  # the previous session's shards go before the next one's are loaded
            session = _open(group, message)
        elif isinstance(message, Call):
            _call(session, message)
        else:
            raise RuntimeError(f"rank 0 sent {type(message).__name__}, which no rank knows")


def _open(group: RankGroup, message: OpenSession) -> TrainingSession | None:
    try:
        return TrainingSession(
            message.config,
            device=group.device,
            max_steps=message.max_steps,
            model_root=message.model_root,
            process_group=group.world,
        )
    except Exception as error:
        if not raised_alike_on_every_rank(error):
            raise
        logger.debug("the session was refused as on rank 0: %s", error)
        return None


def _call(session: TrainingSession | None, call: Call) -> None:
    if session is None:
        raise RuntimeError(f"rank 0 called {call.name} on a session this rank does not hold")
    try:
        getattr(session, call.name)(*call.args, **call.kwargs)
    except Exception as error:
        if not raised_alike_on_every_rank(error):
            raise
        logger.debug("%s was refused as on rank 0: %s", call.name, error)
