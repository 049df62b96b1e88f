"""Bounds on what one request may ask of the session, checked before it is queued.

The server's message size caps the bytes of a request, not the work in them: a 2 MB message of
short texts is thousands of examples, and one 30 MiB text holds the engine thread for most of a
minute while it is tokenized. So counts, characters and tokens are bounded here, before any
tokenizing or model work, and a request over a bound is RESOURCE_EXHAUSTED with what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainwire.contract.config import InputExample
from trainwire.contract.tokens import TokenExample
from trainwire.server.errors import InvalidArgument, ResourceExhausted

MAX_ITEMS = 4096  # texts or id lists per Tokenize / Detokenize request
MAX_EXAMPLES = 1024  # examples per Forward / ForwardBackward request
MAX_TEXT_CHARS = 8 * 1024 * 1024  # characters over all texts of one request
MAX_TOKENS = 1024 * 1024  # ids over all lists or token examples of one request


def check_batch(examples: Sequence[InputExample] | Sequence[TokenExample]) -> None:
    """A training or evaluation batch within the bounds (its contents are checked later)."""
    if len(examples) > MAX_EXAMPLES:
        raise ResourceExhausted(
            f"{len(examples)} examples in one request; the limit is {MAX_EXAMPLES}: split the "
            "batch into microbatches"
        )
    if examples and isinstance(examples[0], TokenExample):
        tokens = sum(len(example) for example in examples)
        if tokens > MAX_TOKENS:
            raise ResourceExhausted(
                f"{tokens} tokens in one request; the limit is {MAX_TOKENS}: split the batch"
            )
        return
    chars = sum(len(e.text) + len(e.completion or "") for e in examples)  # type: ignore[union-attr]
    if chars > MAX_TEXT_CHARS:
        raise ResourceExhausted(
            f"{chars} characters of text in one request; the limit is {MAX_TEXT_CHARS}: split "
            "the batch"
        )


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
