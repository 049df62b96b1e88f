"""The SDK's sessions: which ServiceClients this front knows, and when each was last heard from.

Every ``ServiceClient`` creates a session and heartbeats it every ``SDK_HEARTBEAT_S`` for as long
as it lives (tinker's ``InternalClientHolder._session_heartbeat``), whatever else it is doing; its
calls name the session too (its models' and sampling sessions' ids start with it,
``session_of``). So a session's silence is its client's: how long is the model table's decision
(``model_table``). Times are this process's clock (``clock``, monotonic unless a test gives
another): a session read back after a restart counts as heard from at the restart. A session its
client closed stays known while something of its own may still be fetched, but is never heard
from again (``close``).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator

# The SDK's heartbeat period (tinker 0.38, SESSION_HEARTBEAT_PERIOD_SEC): a live client is never
# silent much longer than this.
SDK_HEARTBEAT_S = 10.0
CLOSED = -math.inf  # when a closed session was last heard from: silent for ever


def session_of(identifier: str) -> str:
    """The SDK session an id belongs to: a session id is ``tw-<hex>``, and every id the front
    hands out under it (a model ``{session}:train:{n}``, a sampling session
    ``{session}:sample:{n}``, a request ``{model or sampling session}/{seq_id}``) starts with it."""
    return identifier.partition(":")[0]


class SdkSessions:
    """The known sessions, each with when it was last heard from."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._heard: dict[str, float] = {}  # session → last heard from (``clock``)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._heard

    def __len__(self) -> int:
        with self._lock:
            return len(self._heard)

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(sorted(self._heard))

    def add(self, session_id: str) -> None:
        """A session created, or read back at a restart: heard from now."""
        with self._lock:
            self._heard[session_id] = self.clock()

    def heard_from(self, session_id: str) -> bool:
        """The session's client spoke now; False (nothing changes) for a session not known, or
        closed."""
        with self._lock:
            if self._heard.get(session_id, CLOSED) == CLOSED:
                return False
            self._heard[session_id] = self.clock()
            return True

    def close(self, session_id: str) -> None:
        """Its client closed the session: it is never heard from again."""
        with self._lock:
            if session_id in self._heard:
                self._heard[session_id] = CLOSED

    def silent_for(self, session_id: str) -> float:
        """Seconds since the session was last heard from (infinite for one not known)."""
        with self._lock:
            heard = self._heard.get(session_id)
            return math.inf if heard is None else self.clock() - heard

    def silent(self, seconds: float) -> set[str]:
        """The sessions silent for more than ``seconds``."""
        with self._lock:
            now = self.clock()
            return {s for s, heard in self._heard.items() if now - heard > seconds}

    def forget(self, session_ids: Iterable[str], *, silent_s: float = -math.inf) -> set[str]:
        """Forget ``session_ids`` that are still silent for more than ``silent_s`` (checked
        again here: one heard from since it was chosen stays); the ones forgotten."""
        with self._lock:
            now = self.clock()
            gone = {s for s in session_ids if s in self._heard and now - self._heard[s] > silent_s}
            for session_id in gone:
                del self._heard[session_id]
            return gone
