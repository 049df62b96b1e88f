"""A session's state digest hashed afresh, for the checks that an operation changed nothing.

``TrainingSession.state_digest()`` is cached until an operation bumps the session's state version,
and the operations that should change nothing (forward, sample, export, a refusal) never bump it:
"the digest before == the digest after" around one of them compares the cache with itself and
holds whatever the operation did to the weights, the optimizer, the RNG or the pending
gradients. These helpers drop the cache first, so the digest is hashed from the live tensors;
``tests/test_fresh_digest.py`` shows the difference. A host's ``Info`` reports the cached digest
too, so the server helpers read the host's session directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwire.contract.outcomes import SessionInfo
from trainwire.server.engine.session import TrainingSession
from trainwire.server.service.host import SessionHost


def fresh_digest(session: TrainingSession) -> str:
    """The digest of the session's state now, hashed from its tensors (never the cache)."""
    session.drop_digest_cache()
    return session.state_digest()


def fresh_info(host: SessionHost) -> SessionInfo:
    """``host.info()`` with its digest hashed afresh ("" while no run is open): call it while
    no operation runs, as a check that one changed nothing does."""
    info = host.info()
    session = host.session
    return dataclasses.replace(info, state_digest=fresh_digest(session) if session else "")


def fresh_server_info(handle: Any) -> SessionInfo:
    """``fresh_info`` of an in-process server's host (a ``serve(...)`` handle)."""
    return fresh_info(handle.session_host)
