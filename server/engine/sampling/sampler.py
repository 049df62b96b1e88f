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

import functools
import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from trainwire.contract.config import is_int
from trainwire.contract.outcomes import PromptLogprobs, Sample, TopLogprobs
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.loss.chunked_logprobs import (
    LOGITS_CHUNK_BYTES,
    HeadScores,
    final_hidden_states,
    head_scores,
    logit_transform,
)
from trainwire.server.engine.loss.token_batches import TokenBatch, encode_token_batch
from trainwire.server.engine.sampling import batch_decode
from trainwire.server.engine.sampling.batch_decode import DecodeJob, Drawn
from trainwire.server.engine.sampling.params import (
    PromptScoring,
    SamplingLimits,
    SamplingParams,
    prompt_problems,
)
from trainwire.server.engine.sampling.stop_strings import StopStringWatch
from trainwire.server.errors import Cancelled, InvalidArgument


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
    """One request of ``TrainingSession.sample_many``: what ``sample`` takes, what it asks
    about its prompt (``scoring``: nothing when it asks for nothing), and where its answer goes:
    ``on_result(samples, the prompt's answer or None)`` once it is done, or ``on_error`` with why
    it was refused or failed."""

    prompt: list[int]
    params: SamplingParams
    scoring: PromptScoring
    on_result: Callable[[list[Sample], PromptLogprobs | None], None]
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
        decoder = self.decoder(model)

        def job(call: SampleCall) -> DecodeJob:
            return self.decode_job(model, call)

        generate(decoder, [job(c) for c in calls], lambda: [job(c) for c in join()])

    def calls(self, model: torch.nn.Module, requests: Sequence[BatchedSample]) -> list[SampleCall]:
        """``requests`` as calls of ``sample_many`` on ``model``: each checked on its own, a
        refused one hears why (``on_error``) and is left out; each accepted one's answer
        carries its prompt's scores (asked for) from ``model`` once its samples are drawn."""
        calls = []
        for request in requests:
            try:
                request.params.check(request.prompt, self.vocab_size, self.limits)
                if request.scoring.asked:
                    request.scoring.check(request.prompt, self.vocab_size, self.limits)
            except InvalidArgument as error:
                request.on_error(error)
                continue
            answer = self._with_prompt_scores(model, request)
            calls.append(
                SampleCall(tuple(request.prompt), request.params, answer, _cancel(request))
            )
        return calls

    def _with_prompt_scores(
        self, model: torch.nn.Module, request: BatchedSample
    ) -> Callable[[list[Sample]], None]:
        """Where ``request``'s samples go: to its caller with its prompt's scores (asked for),
        scored alone on ``model`` after its samples."""

        def answer(samples: list[Sample]) -> None:
            scored = None
            if request.scoring.asked:
                scored = self.prompt_scores(model, request.prompt, request.scoring)
            request.on_result(samples, scored)

        return answer

    def decoder(self, model: torch.nn.Module) -> batch_decode.BatchDecoder:
        """The decoder of ``model``'s samples, with this sampler's EOS, limits and tiles."""
        device = next(model.parameters()).device
        return batch_decode.BatchDecoder(
            model,
            eos_ids=self.eos_ids,
            device=device,
            max_positions=self.limits.max_sample_positions,
            tile_rows=self.decoding_tile_rows(device),
            agree=self.agree,
        )

    def decoding_tile_rows(self, device: torch.device) -> int:
        """The rows of this sampler's decode tiles on ``device`` (``batch_decode.tile_size``
        gives a request's)."""
        if not self.batches:
            # Alone, a request decodes all its rows in one forward (no padding): its samples
            # then depend on its own count of rows only.
            return batch_decode.OWN_ROWS
        return batch_decode.tile_rows_on(device) if self.tile_rows is None else self.tile_rows

    def decode_job(
        self,
        model: torch.nn.Module,
        call: SampleCall,
        on_drawn: Callable[[Drawn], None] | None = None,
    ) -> DecodeJob:
        """``call``'s decode, its stop strings watched; as its last row ends, ``on_drawn`` gets
        its draws (by default: ``answer``, scored on ``model`` at once)."""
        watch = StopStringWatch(call.params.stop_strings, self.decode)
        done = on_drawn or functools.partial(self.answer, model, call)
        return DecodeJob(call.prompt, call.params, watch, done, call.cancel)

    def answer(
        self,
        model: torch.nn.Module,
        call: SampleCall,
        drawn: Drawn,
        hidden_of: Mapping[tuple[int, ...], torch.Tensor] | None = None,
    ) -> None:
        """``call``'s samples, each scored on ``model`` (the trainer's logprobs), to its caller;
        ``hidden_of``: final hidden states of some samples' examples, their model's forward
        already run (``together.sampling``)."""
        device = next(model.parameters()).device
        top_k = call.params.topk_sample_logprobs
        call.on_samples(self._scored(model, call.prompt, drawn, device, top_k, hidden_of or {}))

    def _scored(
        self,
        model: torch.nn.Module,
        prompt: Sequence[int],
        drawn: Drawn,
        device: torch.device,
        top_k: int = 0,
        hidden_of: Mapping[tuple[int, ...], torch.Tensor] = MappingProxyType({}),
    ) -> list[Sample]:
        # Equal samples (every greedy one, say) share one exact pass: the same input gives the
        # same bits, and the pass is a full forward per distinct sample.
        scored: dict[tuple[int, ...], Sample] = {}
        samples = []
        for tokens, reason in drawn:
            key = tuple(tokens)
            if key not in scored:
                hidden = hidden_of.get(key)
                scores = self.scores(model, prompt, key, device, top_k=top_k, hidden=hidden)
                top = _top(scores.top_ids, scores.top_logprobs) if top_k else None
                scored[key] = Sample(key, _floats(scores.picked), reason, top)
            samples.append(replace(scored[key], stop_reason=reason))
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
        scored = self.prompt_scores(model, prompt, PromptScoring(logprobs=True))
        return list(scored.logprobs or ())

    def prompt_scores(
        self, model: torch.nn.Module, prompt: Sequence[int], scoring: PromptScoring
    ) -> PromptLogprobs:
        """What ``scoring`` asks about ``prompt`` (checked here), from one pass over the chunks
        of ``TokenExample(prompt[:-1], prompt[1:])`` from the first position asked for: each
        value bit for bit what ``forward`` of that example gives for that id at that position.
        Called as ``sample`` is (lock, eval mode, no gradients)."""
        scoring.check(prompt, self.vocab_size, self.limits)
        length = len(prompt)
        reported = scoring.first_scored(length)  # the first prompt position reported
        starts = []  # example position p - 1 predicts prompt position p
        if scoring.logprobs or scoring.top_k:
            starts.append(reported - 1)
        if scoring.targets is not None:
            starts.append(scoring.first_target_row())
        start = min(starts, default=length - 1)
        if start >= length - 1:  # a one-token prompt: nothing precedes its only token
            logprobs = (math.nan,) if scoring.logprobs else None
            top = TopLogprobs(scoring.top_k) if scoring.top_k else None
            return PromptLogprobs(reported, logprobs, top)
        device = next(model.parameters()).device
        chosen = None
        if scoring.targets is not None:
            chosen = torch.tensor(scoring.targets, dtype=torch.long, device=device)
        scores = self.scores(
            model, prompt[:1], prompt[1:], device, top_k=scoring.top_k, chosen=chosen, start=start
        )
        return _prompt_answer(scoring, reported, start, scores)

    def logprobs(
        self,
        model: torch.nn.Module,
        prompt: Sequence[int],
        tokens: Sequence[int],
        device: torch.device,
    ) -> tuple[float, ...]:
        """The logprobs of ``tokens`` after ``prompt``, exactly as ``forward`` computes them for
        the one token example ``prompt + tokens`` shifted by one."""
        return _floats(self.scores(model, prompt, tokens, device).picked)

    def scores(
        self,
        model: torch.nn.Module,
        prompt: Sequence[int],
        tokens: Sequence[int],
        device: torch.device,
        *,
        top_k: int = 0,
        chosen: torch.Tensor | None = None,
        start: int | None = None,
        hidden: torch.Tensor | None = None,
    ) -> HeadScores:
        """``HeadScores`` of the positions that predict ``tokens`` after ``prompt`` (from
        position ``start`` of the example on, when given), on the chunks ``forward`` runs for
        the one token example ``prompt + tokens`` shifted by one: the same bits. ``chosen``:
        ids to score at every position of that example, ``(positions, m)``, -1 for none.
        ``hidden``: that example's final hidden states, when its forward has run already."""
        batch = self.scoring_batch(prompt, tokens, device)
        if hidden is None:
            with torch.no_grad():
                hidden, _ = final_hidden_states(model, batch.input_ids, batch.attention_mask)
        length = batch.input_ids.shape[1]
        return head_scores(
            model.get_output_embeddings(),
            logit_transform(model.config),
            hidden,
            batch.targets,
            length,
            top_k=top_k,
            chosen=chosen,
            start=length - len(tokens) if start is None else start,
            budget_bytes=batch.logits_chunk_bytes,
        )

    def scoring_batch(
        self, prompt: Sequence[int], tokens: Sequence[int], device: torch.device
    ) -> TokenBatch:
        """The one token example ``prompt + tokens`` shifted by one, as ``forward`` encodes it
        (no padding: its width is its length)."""
        full = [*prompt, *tokens]
        example = TokenExample(tuple(full[:-1]), tuple(full[1:]))
        return encode_token_batch(
            [example],
            vocab_size=self.vocab_size,
            max_length=len(example),
            pad_id=self.pad_id,
            device=device,
            logits_chunk_bytes=self.logits_chunk_bytes,
        )


def _cancel(request: BatchedSample) -> batch_decode.Cancel | None:
    if request.cancelled is None:
        return None
    gave_up = Cancelled("sample: the caller gave up; decoding stopped")
    return batch_decode.Cancel(request.cancelled, lambda: request.on_error(gave_up))


def _floats(values: torch.Tensor) -> tuple[float, ...]:
    """fp32 values as Python floats (each exactly the fp32 value)."""
    return tuple(values.cpu().tolist())


def _top(ids: torch.Tensor, logprobs: torch.Tensor) -> TopLogprobs:
    """``(n, k)`` top ids and logprobs, flat and compact, their bits as they are."""
    flat_ids, flat_logprobs = array("i"), array("f")
    flat_ids.frombytes(ids.to(torch.int32).cpu().numpy().tobytes())
    flat_logprobs.frombytes(logprobs.to(torch.float32).cpu().numpy().tobytes())
    return TopLogprobs(ids.shape[-1], flat_ids, flat_logprobs)


def _prompt_answer(
    scoring: PromptScoring, reported: int, start: int, scores: HeadScores
) -> PromptLogprobs:
    """``scoring``'s answer from the scores of example positions ``start`` on: logprobs and top
    k from prompt position ``reported`` on (NaN before), the targets' from ``start``
    on (the rows before name no id), None where a target names none."""
    skip = reported - 1 - start  # scored before the first reported (for the targets' rows)
    logprobs = top = targets = None
    if scoring.logprobs:
        logprobs = (math.nan,) * reported + _floats(scores.picked[skip:])
    if scoring.top_k:
        top = _top(scores.top_ids[skip:], scores.top_logprobs[skip:])
    if scoring.targets is not None:
        values = [[0.0] * len(scoring.targets[0])] * start + scores.chosen.cpu().tolist()
        targets = tuple(
            tuple(value if token >= 0 else None for value, token in zip(row, ids, strict=True))
            for row, ids in zip(values, scoring.targets, strict=True)
        )
    return PromptLogprobs(reported, logprobs, top, targets)
