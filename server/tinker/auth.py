"""The SDK's credential: ``X-API-Key``. The SDK itself refuses keys that do not start with
``tml-``, so the server's token for SDK clients must too (checked at start-up)."""

from __future__ import annotations

import hmac

KEY_PREFIX = "tml-"


def check_token(token: str | None) -> None:
    """ValueError for a token the SDK could never send."""
    if token is not None and not token.startswith(KEY_PREFIX):
        raise ValueError(
            f"the Tinker token must start with {KEY_PREFIX!r} (the SDK refuses other keys); "
            f"got one starting {token[:4]!r}"
        )


def refusal(supplied: str | None, expected: str | None) -> str | None:
    """Why a request is refused (None: it may pass); constant time in the key."""
    if expected is None:
        return None
    if not supplied:
        return "missing API key: send it as X-API-Key (TINKER_API_KEY for the SDK)"
    if hmac.compare_digest(supplied.encode(), expected.encode()):
        return None
    return "wrong API key"
