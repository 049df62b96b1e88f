"""Sampling from the live weights, with logprobs that are the trainer's own.

Two passes. Generation decodes incrementally with a KV cache, all samples of a prompt as one
batch, drawing from its own ``torch.Generator`` seeded by the request (never the session's
training RNG). Then each sample's logprobs are recomputed by ``target_logprobs`` on that sample
alone, the very code ``forward`` runs, because logprobs read off an incremental decode (or a
padded batch) differ from a full forward in the last bits, and an on-policy importance ratio
must be exactly 1.

Which weights a sample reads is the caller's choice (``sample_weights.SampleWeights``): the live
ones, an export of the run, or the base model. Putting other weights in for one call, and the
live bits back after, is ``session_sampling``'s job; this module only ever reads the model it is
given.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from trainwire.client.config import is_int
from trainwire.client.outcomes import Sample
from trainwire.client.tokens import TokenExample
from trainwire.server.engine.stop_strings import StopStringWatch, stop_string_problems
from trainwire.server.engine.token_batches import encode_token_batch, target_logprobs
from trainwire.server.errors import InvalidArgument

STOP, LENGTH = "stop", "length"  # Sample.stop_reason


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
        """The settings of each draw. Any finite temperature is computable (see ``_tempered``)."""
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


class Sampler:
    """Samples for one session: its tokenizer's EOS, its vocabulary and its limits."""

    def __init__(
        self,
        *,
        vocab_size: int,
        eos_ids: Sequence[int],
        pad_id: int,
        limits: SamplingLimits,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.limits = limits
        self.decode = decode  # the tokenizer's, for stop strings

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, tokenizer: Any, limits: SamplingLimits | None = None
    ) -> Sampler:
        """A sampler for ``model``'s vocabulary (its embedding rows), positions (its config's
        ``max_position_embeddings``), and ``tokenizer``'s EOS and decoding (stop strings)."""
        eos = tokenizer.eos_token_id
        positions = getattr(model.config, "max_position_embeddings", None)
        limits = replace(
            limits or SamplingLimits(), model_positions=positions if is_int(positions) else None
        )
        return cls(
            vocab_size=model.get_input_embeddings().num_embeddings,
            eos_ids=() if eos is None else (eos,),
            pad_id=tokenizer.pad_token_id,
            limits=limits,
            decode=tokenizer.decode,
        )

    def sample(
        self, model: torch.nn.Module, prompt: Sequence[int], params: SamplingParams
    ) -> list[Sample]:
        """Draw and score ``params.num_samples`` continuations of ``prompt``.

        The caller holds the session's lock, has put the model in eval mode and disabled
        gradients; nothing here touches the session's RNG.
        """
        params.check(prompt, self.vocab_size, self.limits)
        device = next(model.parameters()).device
        watch = StopStringWatch(params.stop_strings, self.decode)
        drawn = generate(model, prompt, params, eos_ids=self.eos_ids, device=device, watch=watch)
        # Equal samples (every greedy one, say) share one exact pass: the same input gives the
        # same bits, and the pass is a full forward per distinct sample.
        scored: dict[tuple[int, ...], tuple[float, ...]] = {}
        samples = []
        for tokens, reason in drawn:
            key = tuple(tokens)
            if key not in scored:
                scored[key] = self.logprobs(model, prompt, key, device)
            samples.append(Sample(key, scored[key], reason))
        return samples

    def check_prompt(self, prompt: Sequence[int]) -> None:
        """InvalidArgument naming every problem of a prompt to score, before any work."""
        problems = prompt_problems(prompt, self.vocab_size, self.limits)
        if problems:
            raise InvalidArgument("prompt_logprobs: " + "; ".join(problems))

    def prompt_logprobs(self, model: torch.nn.Module, prompt: Sequence[int]) -> list[float]:
        """Each prompt token's logprob given the tokens before it, NaN for the first (nothing
        precedes it): ``logprobs``' pass, so the rest are bit for bit what ``forward`` gives for
        ``TokenExample(prompt[:-1], prompt[1:])``. Called as ``sample`` is (lock, eval mode, no
        gradients)."""
        self.check_prompt(prompt)
        if len(prompt) < 2:
            return [math.nan]
        device = next(model.parameters()).device
        return [math.nan, *self.logprobs(model, prompt[:1], prompt[1:], device)]

    def logprobs(
        self,
        model: torch.nn.Module,
        prompt: Sequence[int],
        tokens: Sequence[int],
        device: torch.device,
    ) -> tuple[float, ...]:
        """The logprobs of ``tokens`` after ``prompt``, exactly as ``forward`` computes them for
        the one token example ``prompt + tokens`` shifted by one."""
        full = [*prompt, *tokens]
        example = TokenExample(tuple(full[:-1]), tuple(full[1:]))
        batch = encode_token_batch(
            [example],
            vocab_size=self.vocab_size,
            max_length=len(example),
            pad_id=self.pad_id,
            device=device,
        )
        values = batch.split(target_logprobs(model, batch)[batch.mask])[0]
        return tuple(values[len(values) - len(tokens) :])


def generate(
    model: torch.nn.Module,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int],
    device: torch.device,
    watch: StopStringWatch | None = None,
) -> list[tuple[list[int], str]]:
    """Decode ``params.num_samples`` continuations of ``prompt``: (new tokens, stop reason).

    A row ends after a stop token or EOS, or once ``watch`` sees a stop string in its text. Every
    row draws at every step until all have ended, so where one row stops never moves another
    row's draws. Runs under ``torch.no_grad`` with the model in eval mode (the caller's job).
    """
    stops = set(params.stop_tokens) | set(eos_ids)
    generator = torch.Generator(device=device).manual_seed(params.seed)
    rows = params.num_samples
    input_ids = torch.tensor([list(prompt)] * rows, dtype=torch.long, device=device)
    attention = torch.ones_like(input_ids)
    cache = DynamicCache()  # filled in place by every forward below
    model_kwargs = _decode_keywords(model, cache)
    sampled: list[list[int]] = [[] for _ in range(rows)]
    reasons: list[str | None] = [None] * rows
    for _ in range(params.max_tokens):
        output = model(input_ids=input_ids, attention_mask=attention, **model_kwargs)
        chosen = _choose(output.logits[:, -1, :].float(), params, generator)
        for row, token in enumerate(chosen.tolist()):
            if reasons[row] is None:
                sampled[row].append(token)
                if token in stops or (watch and watch.reached(sampled[row])):
                    reasons[row] = STOP
        if all(reason is not None for reason in reasons):
            break
        input_ids = chosen.unsqueeze(-1)
        attention = torch.cat([attention, torch.ones_like(input_ids)], dim=-1)
    return [(tokens, reason or LENGTH) for tokens, reason in zip(sampled, reasons, strict=True)]


def _choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    """One token per row: greedy at temperature 0, else temperature → top-k → top-p → draw."""
    if params.temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = _tempered(logits, float(params.temperature))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        ordered_probabilities = torch.softmax(ordered, dim=-1)
        # Drop a token once the ones before it already reach top_p; the first always stays.
        drop = (ordered_probabilities.cumsum(dim=-1) - ordered_probabilities) >= params.top_p
        # Stated, not left to the comparison: a top_p that float32 rounds to 0 (5e-324, say)
        # would drop every token, and a draw from nothing is NaN.
        drop[:, 0] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
    probabilities = torch.softmax(logits, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``, computed stably where that overflows.

    A temperature near 0 (1e-300, or any that float32 rounds to 0) sends logits / temperature
    to inf, and a softmax of inf is NaN: the draw would crash on a caller's finite value. There,
    and only there, the same distribution comes from each row shifted by its largest logit
    first, in float64: the largest stay 0 and the rest fall to very negative values or -inf, so
    the draw takes the (tied) most likely tokens, the limit the caller asked for. Any
    temperature whose quotient is finite takes the plain division, so its samples keep every bit.
    """
    scaled = logits / temperature
    if temperature >= 1 or bool(torch.isfinite(scaled.amax(dim=-1)).all()):
        return scaled
    wide = logits.double()
    return (wide - wide.amax(dim=-1, keepdim=True)) / temperature


def _decode_keywords(model: torch.nn.Module, cache: DynamicCache) -> dict[str, Any]:
    """The keywords of an incremental decode step: the cache under ``cache``, the keyword of
    transformers' current cache API, where the model takes it (``past_key_values`` on the older
    releases the package supports), and logits for the last position only where it can."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    accepted = inspect.signature(base.forward).parameters
    keywords: dict[str, Any] = {"use_cache": True}
    keywords["cache" if "cache" in accepted else "past_key_values"] = cache
    if "logits_to_keep" in accepted:
        keywords["logits_to_keep"] = 1
    return keywords


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
