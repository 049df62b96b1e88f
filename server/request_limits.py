"""Bounds on the read-only requests that take lists (Tokenize, Detokenize), checked before work.

Training requests are bounded by the batch they encode (``max_length`` and the server's message
size); these two would otherwise let one call hold the executor for as long as it likes.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainwire.server.errors import InvalidArgument, ResourceExhausted

MAX_ITEMS = 4096  # texts or id lists per request
MAX_TEXT_CHARS = 4 * 1024 * 1024  # characters over all texts of one request
MAX_TOKENS = 1024 * 1024  # ids over all lists of one request


def check_texts(texts: Sequence[str]) -> None:
    _check_count(len(texts), "texts")
    if any(not isinstance(text, str) for text in texts):
        raise InvalidArgument("tokenize takes strings")
    chars = sum(len(text) for text in texts)
    if chars > MAX_TEXT_CHARS:
        raise ResourceExhausted(
            f"tokenize: {chars} characters in one request; the limit is {MAX_TEXT_CHARS}: "
            "send them in several requests"
        )


def check_token_lists(token_lists: Sequence[Sequence[int]]) -> None:
    _check_count(len(token_lists), "token lists")
    tokens = sum(len(ids) for ids in token_lists)
    if tokens > MAX_TOKENS:
        raise ResourceExhausted(
            f"detokenize: {tokens} ids in one request; the limit is {MAX_TOKENS}: send them in "
            "several requests"
        )


def _check_count(count: int, what: str) -> None:
    if count > MAX_ITEMS:
        raise ResourceExhausted(
            f"{count} {what} in one request; the limit is {MAX_ITEMS}: send them in several"
        )
