"""What a sample request may ask for and how it is checked: ``SamplingParams`` (one request's
settings) against ``SamplingLimits`` (the session's bounds), every problem named at once.

Below the sampler and its decode: the draws (``draws``) and the batched decode
(``batch_decode``) read a request's settings, and the sampler checks them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainwire.contract.config import is_int
from trainwire.server.engine.sampling.stop_strings import stop_string_problems
from trainwire.server.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingLimits:
    """What one Sample request may ask for; over a limit is INVALID_ARGUMENT before any work.

    Each count alone is not what costs memory: every sample decodes its own copy of the prompt
    with its own KV cache, so what one request holds at once grows with
    samples × (prompt + max_tokens). ``max_sample_positions`` bounds that product (64 samples
    of 4096 positions, or fewer samples of longer ones). ``model_positions`` is the model's
    ``max_position_embeddings`` (None where it has none): a prompt plus ``max_tokens`` past it
    is refused, as training refuses a sequence past ``max_length``.
    """

    max_tokens: int = 4096
    max_samples: int = 64
    max_prompt_tokens: int = 32768
    max_sample_positions: int = 64 * 4096
    max_stop_tokens: int = 1024
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    # Ids a position reports beside its token: the width of a top k, the columns of target ids.
    max_logprob_ids: int = 20
    model_positions: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """A validated sampling request (see ``TrainingSession.sample``)."""

    max_tokens: int
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0
    stop_strings: tuple[str, ...] = ()  # see ``stop_strings``: the sample's text ends on one
    # The top k ids a sampled position reports with their logprobs (0: none); draws ignore it.
    topk_sample_logprobs: int = 0

    def check(self, prompt: Sequence[int], vocab_size: int, limits: SamplingLimits) -> None:
        """InvalidArgument naming every bad argument at once."""
        problems = prompt_problems(prompt, vocab_size, limits)
        if len(self.stop_tokens) > limits.max_stop_tokens:
            problems.append(f"{len(self.stop_tokens)} stop_tokens; the limit is "
                            f"{limits.max_stop_tokens}")  # fmt: skip
        elif _bad_ids(self.stop_tokens, vocab_size):
            problems.append(f"stop_tokens must be ids in [0, {vocab_size})")
        problems += stop_string_problems(
            self.stop_strings,
            max_count=limits.max_stop_strings,
            max_chars=limits.max_stop_string_chars,
        )
        counts = self._count_problems(limits)
        if not counts and not problems:  # the sizes below only mean something for valid counts
            counts = size_problems(len(prompt), self.max_tokens, self.num_samples, limits)
        problems += counts
        problems += self._draw_problems()
        problems += width_problems("topk_sample_logprobs", self.topk_sample_logprobs, limits)
        if problems:
            raise InvalidArgument("sample: " + "; ".join(problems))

    def _count_problems(self, limits: SamplingLimits) -> list[str]:
        problems = []
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= limits.max_tokens:
            problems.append(f"max_tokens must be in [1, {limits.max_tokens}], "
                            f"got {self.max_tokens!r}")  # fmt: skip
        if not is_int(self.num_samples) or not 1 <= self.num_samples <= limits.max_samples:
            problems.append(f"num_samples must be in [1, {limits.max_samples}], "
                            f"got {self.num_samples!r}")  # fmt: skip
        return problems

    def _draw_problems(self) -> list[str]:
        """The settings of each draw. Any finite temperature is computable
        (``draws._tempered``)."""
        problems = []
        if not _is_number(self.temperature) or self.temperature < 0:
            problems.append(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 keeps every token), got {self.top_k!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            problems.append(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        return problems


@dataclass(frozen=True)
class PromptScoring:
    """What a sample request asks about its prompt (``outcomes.PromptLogprobs`` answers it):
    each token's logprob (``logprobs``), the top ``top_k`` ids of each position, both for the
    last ``last_n`` tokens only when given (it needs ``logprobs``), and the logprobs of the ids
    ``targets`` names: one row a position after the first, ``[len(prompt) - 1, K]``, -1 where
    it names none (the rows before the first named id are not scored)."""

    logprobs: bool = False
    top_k: int = 0
    last_n: int | None = None
    targets: tuple[tuple[int, ...], ...] | None = None

    @property
    def asked(self) -> bool:
        return self.logprobs or bool(self.top_k) or self.targets is not None

    def check(self, prompt: Sequence[int], vocab_size: int, limits: SamplingLimits) -> None:
        """InvalidArgument naming every problem at once (the prompt's own included)."""
        problems = prompt_problems(prompt, vocab_size, limits)
        problems += width_problems("topk_prompt_logprobs", self.top_k, limits)
        scored = len(prompt) - 1  # positions with a token before them
        if self.last_n is not None:
            if not self.logprobs:
                problems.append("prompt_logprobs_last_n needs prompt_logprobs")
            if not is_int(self.last_n) or not 1 <= self.last_n <= scored:
                problems.append(f"prompt_logprobs_last_n must be in [1, {scored}] (the prompt's "
                                f"tokens after the first), got {self.last_n!r}")  # fmt: skip
        if self.targets is not None:
            problems += target_problems(self.targets, scored, vocab_size, limits)
        if problems:
            raise InvalidArgument("sample: " + "; ".join(problems))

    def first_scored(self, prompt_length: int) -> int:
        """The first prompt position whose logprob and top k are reported (at least 1)."""
        return prompt_length - self.last_n if self.last_n is not None else 1

    def first_target_row(self) -> int:
        """The first row of ``targets`` that names an id (the rows before it need no scores)."""
        rows = self.targets or ()
        return next((i for i, row in enumerate(rows) if any(id_ >= 0 for id_ in row)), len(rows))


def width_problems(name: str, width: object, limits: SamplingLimits) -> list[str]:
    """A top-k width: 0 (none) up to ``max_logprob_ids``."""
    if is_int(width) and 0 <= width <= limits.max_logprob_ids:  # type: ignore[operator]
        return []
    return [f"{name} must be in [0, {limits.max_logprob_ids}], got {width!r}"]


def target_problems(
    targets: Sequence[Sequence[int]], rows: int, vocab_size: int, limits: SamplingLimits
) -> list[str]:
    """``target_prompt_logprobs``: ``rows`` rows of one width in [1, ``max_logprob_ids``], ids
    in the vocabulary or -1, at least one id."""
    if not targets:
        return ["target_prompt_logprobs names no id"]
    widths = {len(row) for row in targets}
    if len(targets) != rows or len(widths) != 1:
        return [f"target_prompt_logprobs must have {rows} rows (the prompt's tokens after the "
                "first) of one width"]  # fmt: skip
    (width,) = widths
    if not 1 <= width <= limits.max_logprob_ids:
        return [f"target_prompt_logprobs rows must hold 1 to {limits.max_logprob_ids} ids, "
                f"got {width}"]  # fmt: skip
    ids = [id_ for row in targets for id_ in row]
    if any(not is_int(id_) or not -1 <= id_ < vocab_size for id_ in ids):
        return [f"target_prompt_logprobs must hold ids in [0, {vocab_size}) or -1 (none)"]
    if all(id_ == -1 for id_ in ids):
        return ["target_prompt_logprobs names no id (every cell is -1)"]
    return []


def size_problems(
    prompt_tokens: int, max_tokens: int, num_samples: int, limits: SamplingLimits
) -> list[str]:
    """What is too big about a request whose counts are each within their bounds: a sequence
    past the model's positions, or more token positions at once than ``max_sample_positions``."""
    positions = prompt_tokens + max_tokens
    problems = []
    if limits.model_positions is not None and positions > limits.model_positions:
        problems.append(
            f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} make {positions} "
            f"positions; the model has {limits.model_positions} (its max_position_embeddings): "
            "shorten the prompt or lower max_tokens"
        )
    if num_samples * positions > limits.max_sample_positions:
        problems.append(
            f"num_samples {num_samples} x (prompt {prompt_tokens} + max_tokens {max_tokens}) is "
            f"{num_samples * positions} token positions at once; the limit is "
            f"{limits.max_sample_positions}: ask for fewer samples, or shorter ones"
        )
    return problems


def prompt_problems(prompt: Sequence[int], vocab_size: int, limits: SamplingLimits) -> list[str]:
    """What is wrong with a prompt to sample or score: empty, too long (for the limits or for
    the model's positions), ids outside the vocab."""
    problems = []
    positions = limits.model_positions
    if not prompt:
        problems.append("prompt_tokens is empty: give at least one token")
    elif len(prompt) > limits.max_prompt_tokens:
        problems.append(f"the prompt has {len(prompt)} tokens; the limit is "
                        f"{limits.max_prompt_tokens}")  # fmt: skip
    elif positions is not None and len(prompt) > positions:
        problems.append(f"the prompt has {len(prompt)} tokens; the model has {positions} "
                        "positions (its max_position_embeddings)")  # fmt: skip
    if _bad_ids(prompt, vocab_size):
        problems.append(f"prompt_tokens must be ids in [0, {vocab_size})")
    return problems


def _bad_ids(ids: Sequence[int], vocab_size: int) -> bool:
    return any(not is_int(i) or not 0 <= i < vocab_size for i in ids)


def _is_number(value: object) -> bool:
    """An int or float with a finite float value (an int past float's range is not)."""
    if not (is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except OverflowError:
        return False
