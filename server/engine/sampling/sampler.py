"""Sampling from the live weights, with logprobs that are the trainer's own.

Two passes. Generation decodes incrementally with a KV cache (``batch_decode``: the rows of
requests waiting together decode as one batch, in tiles of a fixed shape, so a request's
samples never depend on its company), each request drawing from its own ``torch.Generator``
seeded by the request (never the session's training RNG). Then each sample's logprobs are
recomputed by ``token_logprobs`` on that sample alone, the very code ``forward`` runs, because
logprobs read off an incremental decode (or a padded batch) differ from a full forward in the
last bits, and an on-policy importance ratio must be exactly 1.

Which weights a sample reads is the caller's choice (``sample_weights.SampleWeights``): the live
ones, an export of the run, or the base model. Putting other weights in for one call, and the
live bits back after, is ``TrainingSession.sample``'s job; this module only ever reads the model
it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainwire.contract.config import is_int
from trainwire.contract.outcomes import Sample
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.loss.chunked_logprobs import LOGITS_CHUNK_BYTES
from trainwire.server.engine.loss.token_batches import encode_token_batch, token_logprobs
from trainwire.server.engine.sampling import batch_decode
from trainwire.server.engine.sampling.batch_decode import DecodeJob, Drawn
from trainwire.server.engine.sampling.params import SamplingLimits, SamplingParams, prompt_problems
from trainwire.server.engine.sampling.stop_strings import StopStringWatch
from trainwire.server.errors import InvalidArgument


@dataclass(frozen=True)
class SampleCall:
    """One request of ``Sampler.sample_many``: its prompt, its checked settings, and where its
    samples go once its last row has ended."""

    prompt: tuple[int, ...]
    params: SamplingParams
    on_samples: Callable[[list[Sample]], None]
    cancel: batch_decode.Cancel | None = None


@dataclass(frozen=True)
class BatchedSample:
    """One request of ``TrainingSession.sample_many``: what ``sample`` takes, whether the prompt
    is scored too (``prompt_logprobs``), and where its answer goes: ``on_result(samples,
    prompt_logprobs or None)`` once it is done, or ``on_error`` with why it was refused or
    failed."""

    prompt: list[int]
    params: SamplingParams
    with_prompt_logprobs: bool
    on_result: Callable[[list[Sample], list[float] | None], None]
    on_error: Callable[[Exception], None]
    cancelled: Callable[[], bool] | None = None  # whether the caller gave up (polled per step)


def generate(
    decoder: batch_decode.BatchDecoder,
    jobs: Sequence[DecodeJob],
    join: Callable[[], list[DecodeJob]],
) -> None:
    """The decode every sample goes through (``batch_decode.decode``): the one place a request
    reaches the model, so it is reached only by requests that passed their checks."""
    batch_decode.decode(decoder, jobs, join)


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
        tile_rows: int | None = None,
        batches: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.limits = limits
        self.decode = decode  # the tokenizer's, for stop strings
        # Rows of every decode forward (``batch_decode``; None: the device's size).
        self.tile_rows = tile_rows
        # Whether concurrent requests may decode as one batch (the service's ``sample_batching``).
        # False decodes each alone, all its rows in one forward of its own row count (no
        # padding): for a device whose kernels give a row other bits beside other rows even in
        # tiles of one shape, or a single-request latency on CPU that tiles would cost (see
        # docs/BENCHMARKS.md). Samples differ between the two modes, never within one.
        self.batches = batches
        # On a sharded session, rank 0's draws made the group's (``batch_decode``); None in one
        # process. Set once the model is sharded (``session.setup.shard_for_group``).
        self.agree: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The trainer's chunking of the head (``chunked_logprobs``), so a sample's logprobs are
        # the trainer's bits; the session sets its own.
        self.logits_chunk_bytes = LOGITS_CHUNK_BYTES

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
        drawn: list[list[Sample]] = []
        self.sample_many(model, [SampleCall(tuple(prompt), params, drawn.append)])
        return drawn[0]

    def sample_many(
        self,
        model: torch.nn.Module,
        calls: Sequence[SampleCall],
        join: Callable[[], list[SampleCall]] = list,
    ) -> None:
        """Decode ``calls`` (each checked by the caller) as one batch, and those ``join`` hands
        over between steps; each call's ``on_samples`` gets its samples, scored, as it ends.

        A call's samples are those ``sample`` gives it alone (``batch_decode`` says why), so
        whatever decodes beside it changes none of its bits. Called as ``sample`` is.
        """
        device = next(model.parameters()).device
        decoder = batch_decode.BatchDecoder(
            model,
            eos_ids=self.eos_ids,
            device=device,
            max_positions=self.limits.max_sample_positions,
            # Alone, a request decodes all its rows in one forward (no padding): its samples
            # then depend on its own count of rows only.
            tile_rows=self.tile_rows if self.batches else batch_decode.OWN_ROWS,
            agree=self.agree,
        )

        def job(call: SampleCall) -> DecodeJob:
            def done(drawn: Drawn) -> None:
                call.on_samples(self._scored(model, call.prompt, drawn, device))

            watch = StopStringWatch(call.params.stop_strings, self.decode)
            return DecodeJob(call.prompt, call.params, watch, done, call.cancel)

        generate(decoder, [job(c) for c in calls], lambda: [job(c) for c in join()])

    def _scored(
        self, model: torch.nn.Module, prompt: Sequence[int], drawn: Drawn, device: torch.device
    ) -> list[Sample]:
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
            logits_chunk_bytes=self.logits_chunk_bytes,
        )
        values = batch.split(token_logprobs(model, batch))[0]
        return tuple(values[len(values) - len(tokens) :])
