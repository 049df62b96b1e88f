"""Where the session host stands, and what that lets a caller do.

idle → (Open) open → (Close) closed → (Open of a new run id) open ... A server started on a state
directory that holds an open run is ``restoring`` until recovery has reopened it from its latest
checkpoint. ``failed`` means the session cannot be trusted (broken midway by a failed operation,
or a journal that could not commit): only a restart, which restores the latest checkpoint, makes
it trustworthy again, so callers hear UNAVAILABLE and retry until it has happened, and health
says NOT_SERVING so a supervisor restarts the process. A shutdown refuses new operations while
the one in flight finishes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainwire.contract import outcomes
from trainwire.contract.outcomes import SessionInfo
from trainwire.server.errors import FailedPrecondition, NotFound, Unavailable

logger = logging.getLogger(__name__)

RESTORING_MESSAGE = "the server is restoring its session after a restart; retry shortly"


class Lifecycle:
    """The host's phase (``outcomes.IDLE`` ... ``FAILED``), its failure and its health signal.

    ``on_serving`` hears True/False whenever the host can/cannot take operations; it never hears
    True once the host failed or began to shut down.
    """

    def __init__(self, on_serving: Callable[[bool], None] | None = None) -> None:
        self.phase = outcomes.IDLE
        self.failure = ""
        self.shutting_down = False
        self.closed_info: SessionInfo | None = None  # the run closed last, as it closed
        self._on_serving = on_serving

    def idle_info(self, pending_run_id: str, device: str) -> SessionInfo:
        """Where things stand while no run is open: the run closed last, or the one a restart
        is restoring (``pending_run_id``)."""
        if self.phase == outcomes.CLOSED and self.closed_info is not None:
            return self.closed_info
        return SessionInfo(run_id=pending_run_id, device=device, state=self.phase)

    def closed_run_info(
        self, run_id: str, open_run_id: str | None, recorded: bool, device: str
    ) -> SessionInfo:
        """A Close of ``run_id`` when it is not the open run: already closed (``recorded`` on
        disk), or refused while another run is open (nothing is closed)."""
        if open_run_id is not None:
            raise FailedPrecondition(
                f"run {run_id!r} is not the open run ({open_run_id!r}); nothing was closed"
            )
        if self.closed_info is not None and self.closed_info.run_id == run_id:
            return self.closed_info
        if not recorded:
            raise NotFound(f"no run {run_id!r} on this server")
        return SessionInfo(run_id=run_id, device=device, state=outcomes.CLOSED)

    def require(self, *phases: str) -> None:
        """Refuse a call that needs one of ``phases``, with what the caller should do instead."""
        if self.phase in phases:
            return
        if self.phase == outcomes.RESTORING:
            raise Unavailable(RESTORING_MESSAGE)
        if self.phase == outcomes.FAILED:
            # A restart restores the latest checkpoint: callers retry until it has happened.
            raise Unavailable(f"the server cannot serve its session: {self.failure}")
        if self.phase == outcomes.CLOSED:
            raise FailedPrecondition("the session was closed; open a new run id first")
        raise FailedPrecondition("no session is open; call Open first")

    def refuse_if_unavailable(self) -> None:
        """An operation is UNAVAILABLE while the server restores or shuts down (retry later)."""
        if self.shutting_down:
            raise Unavailable("the server is shutting down; retry against its replacement")
        if self.phase == outcomes.RESTORING:
            raise Unavailable(RESTORING_MESSAGE)

    def fail(self, message: str) -> None:
        """The session cannot be trusted any more: every operation is refused until a restart."""
        self.failure = message
        self.phase = outcomes.FAILED
        self.set_serving(False)
        logger.error("session unusable: %s", message)

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        """Tell health whether operations are taken now (never once failed or shutting down)."""
        if self._on_serving is not None:
            self._on_serving(serving and not self.shutting_down and self.phase != outcomes.FAILED)
