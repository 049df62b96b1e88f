"""Token-level examples: what reinforcement learning, distillation and custom losses train on.

A ``TokenExample`` is one sequence already tokenized and shifted: position ``i`` of ``tokens``
predicts ``target_tokens[i]``. The per-token inputs of the losses ride beside it as one float
per position. torch-free, so a laptop can build them from a server's ``tokenize``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trainwire.contract.config import InputExample

DEFAULT_LOSS = "cross_entropy"  # the loss_fn a call names when it names none
TOKEN_FIELDS = ("tokens", "target_tokens")
FLOAT_FIELDS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")


@dataclass(frozen=True, slots=True)
class TokenExample:
    """One sequence for the token-level losses; every field holds N >= 1 values.

    Attributes:
        tokens: the input token ids.
        target_tokens: the id each position predicts (``tokens`` shifted by one, usually).
        weights: cross-entropy scale per token (None: all 1.0; negative values are allowed).
        logprobs: the sampling policy's log-probability q of each target (ratio losses).
        advantages: the advantage A of each target (policy-gradient losses).
        sequence_ratio_mask: which targets (non-zero) a sequence-level ratio averages over
            (``gspo``: usually 1.0 on the sampled tokens, 0.0 on the prompt).

    Lists are stored as tuples, so an example is hashable and cannot change under a request.
    Raises ``ValueError`` naming the field for a wrong type, an unequal length or a non-finite
    float.
    """

    tokens: tuple[int, ...]
    target_tokens: tuple[int, ...]
    weights: tuple[float, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    advantages: tuple[float, ...] | None = None
    sequence_ratio_mask: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in TOKEN_FIELDS:
            object.__setattr__(self, name, _token_ids(name, getattr(self, name)))
        length = len(self.tokens)
        if length == 0:
            raise ValueError("tokens is empty: a token example needs at least one position")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _finite_floats(name, value))
        for name in (*TOKEN_FIELDS, *FLOAT_FIELDS):
            value = getattr(self, name)
            if value is not None and len(value) != length:
                raise ValueError(
                    f"{name} has {len(value)} values but tokens has {length}: every field "
                    "holds one value per position"
                )

    def __len__(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, as JSON-able lists (what the payload digest covers)."""
        out: dict[str, Any] = {name: list(getattr(self, name)) for name in TOKEN_FIELDS}
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value)
        return out

    @classmethod
    def from_sequence(
        cls, sequence: Sequence[int], *, prompt_length: int = 0, **per_target: Any
    ) -> TokenExample:
        """Shift one full sequence by one: inputs ``sequence[:-1]``, targets ``sequence[1:]``.

        With ``prompt_length`` (tokens of the sequence that are prompt), the weights default to
        0 on the targets inside the prompt and 1 after it, so cross-entropy learns the
        continuation only. ``per_target`` fields (``logprobs``, ``advantages``, ``weights``,
        ``sequence_ratio_mask``) must then have ``len(sequence) - 1`` values.
        """
        ids = list(sequence)
        if len(ids) < 2:
            raise ValueError("a sequence to shift needs at least two tokens")
        if prompt_length and "weights" not in per_target:
            first = max(prompt_length - 1, 0)
            per_target["weights"] = [0.0] * first + [1.0] * (len(ids) - 1 - first)
        return cls(tuple(ids[:-1]), tuple(ids[1:]), **per_target)


def is_token_batch(examples: Sequence[object]) -> bool:
    """True when ``examples`` are TokenExamples; ValueError when text and tokens are mixed."""
    kinds = {isinstance(example, TokenExample) for example in examples}
    if len(kinds) > 1:
        raise ValueError("a batch mixes token examples and text examples: send one kind")
    return kinds == {True}


def _values(name: str, values: Any, what: str) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a sequence of {what}, got {type(values).__name__}")
    return tuple(values)


def _token_ids(name: str, values: Any) -> tuple[int, ...]:
    out = _values(name, values, "token ids")
    for i, value in enumerate(out):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"{name}[{i}] must be a token id (an int >= 0), got {value!r}")
    return tuple(int(value) for value in out)


def _finite_floats(name: str, values: Any) -> tuple[float, ...]:
    out = _values(name, values, "numbers")
    for i, value in enumerate(out):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}[{i}] must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name}[{i}] is {value}: every value must be finite")
    return tuple(float(value) for value in out)


# A batch: text examples or token examples, never both (``is_token_batch`` tells which).
Examples = Sequence[InputExample] | Sequence[TokenExample]
