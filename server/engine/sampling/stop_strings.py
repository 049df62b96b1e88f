"""Stop strings: a sample ends once its decoded text contains one of them.

What a sample then holds is the Tinker SDK's convention (the one the cookbook's renderers parse):
every token up to and including the one whose text completes the stop string, so decoding the
sample and splitting it on the string gives the content before it, and the sample's logprobs
cover every one of those tokens. Its stop reason is ``"stop"``, as for a stop token.

The text is the sample's own (not the prompt's), decoded as ``tokenizer.decode`` does with special
tokens kept. Decoding the whole sample after every new token would cost a decode of up to
``max_tokens`` tokens per token; a string not yet present can only appear where the newest token
ends the text, so each step decodes a short tail instead and the whole sample is decoded only to
confirm a hit (a tail's first characters can differ from the whole text's: a cut multi-byte
character, a leading space a tokenizer strips).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Tokens decoded before the ones that can hold a stop string: enough that what a tail decode
# may get wrong at its start (a cut character, a stripped space) falls outside any match.
TAIL_MARGIN_TOKENS = 8

Decode = Callable[[list[int]], str]


def stop_string_problems(
    stop_strings: Sequence[object], *, max_count: int, max_chars: int
) -> list[str]:
    """What is wrong with a request's stop strings: too many, not text, empty, too long."""
    if len(stop_strings) > max_count:
        return [f"{len(stop_strings)} stop_strings; the limit is {max_count}"]
    problems = []
    for index, text in enumerate(stop_strings):
        if not isinstance(text, str):
            problems.append(f"stop_strings[{index}] must be a string, got {type(text).__name__}")
        elif not text:
            problems.append(
                f"stop_strings[{index}] is empty: every text contains it, so give at least one "
                "character"
            )
        elif len(text) > max_chars:
            problems.append(
                f"stop_strings[{index}] has {len(text)} characters; the limit is {max_chars}"
            )
    return problems


class StopStringWatch:
    """Tells whether a growing sample's text has reached one of ``stop_strings``."""

    def __init__(self, stop_strings: Sequence[str], decode: Decode | None) -> None:
        self.stop_strings = tuple(stop_strings)
        if self.stop_strings and decode is None:
            raise ValueError("stop strings need the tokenizer's decode")
        self.decode = decode
        # Every token adds at least one byte to the text, so a string of n UTF-8 bytes that the
        # newest token completes lies within the last n tokens (plus one it may start inside).
        longest = max((len(s.encode("utf-8")) for s in self.stop_strings), default=0)
        self.tail_tokens = longest + 1 + TAIL_MARGIN_TOKENS

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def reached(self, tokens: list[int]) -> bool:
        """True when the text of ``tokens`` (a sample so far) contains a stop string. Called
        after every new token, so a hit is always new: it ends with the newest token."""
        if not self.stop_strings:
            return False
        assert self.decode is not None
        if not self._holds_one(self.decode(tokens[-self.tail_tokens :])):
            return False
        return len(tokens) <= self.tail_tokens or self._holds_one(self.decode(tokens))

    def _holds_one(self, text: str) -> bool:
        return any(stop in text for stop in self.stop_strings)
