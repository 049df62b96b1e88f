"""Target logprobs without ever holding ``[tokens x vocabulary]``: the head runs over chunks.

Every token logprob the engine computes (every loss, ``forward``, prompt logprobs and the
logprobs a sample reports) comes from ``chunked_target_logprobs``. The model runs once for its
final hidden states: a pre-hook on its output embeddings keeps their input and hands the head
zero positions, so the model's own forward (FSDP's gathering, PEFT's adapters, gradient
checkpointing) runs as it always would, and computes no logits. Then the head (the real module,
LoRA on the unembedding included), the architecture's logit transform, ``logsumexp`` and the
gathered target run over chunks of positions, each chunk under non-reentrant checkpointing: its
logits are freed once its logprobs exist and recomputed in the backward, one chunk at a time.

A request whose target positions all fit one chunk's budget together (a short batch, or a small
vocabulary) takes one chunk: each row's head runs on that row's positions as above (the same
matmul shapes, so the same bits), and the rest, which works position by position, runs once
over all of them, kept for the backward rather than recomputed (they hold no more than one
chunk's logits). Which way a request goes depends on its lengths alone.

Chunks never cross an example: each row of a batch is cut into chunks from its first position,
so an example's chunks are the same alone and in any company, and the sampler, which scores a
sample alone, runs the very shapes ``forward`` of that sample runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from trainwire.server.errors import FailedPrecondition

# What one chunk's fp32 logits may take. Its backward holds about four tensors of that size
# (logits, their softmax, the gather's gradient, the logits' gradient), so a step's loss peaks
# near four times this, whatever the sequence length. 32 MiB is 55 positions of a 151,936-entry
# vocabulary: a matmul that wide keeps the head's throughput (docs/BENCHMARKS.md).
LOGITS_CHUNK_BYTES = 32 * 2**20
FP32_BYTES = 4

LogitTransform = Callable[[torch.Tensor], torch.Tensor]
Head = Callable[[torch.Tensor], torch.Tensor]  # hidden states to the head's output


def positions_per_chunk(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """How many positions one chunk holds: as many as ``budget_bytes`` of fp32 logits fit.

    A function of the vocabulary and the budget alone, both fixed for a session, never of the
    memory free at the moment: the chunks decide the head's matmul shapes, and so the bits, and
    a run must give the same bits every time it runs and after every resume.
    """
    return max(1, budget_bytes // (vocab_size * FP32_BYTES))


def chunked_target_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    lengths: Sequence[int],
    *,
    budget_bytes: int = LOGITS_CHUNK_BYTES,
) -> torch.Tensor:
    """log p(target) of the first ``lengths[b]`` positions of every row ``b``, flattened in row
    order, in fp32 (the order ``tensor[mask]`` reads a right-padded batch in).

    Recorded for backward when gradients are enabled (the chunks are recomputed there, unless
    one chunk holds the whole request); under ``torch.no_grad`` nothing is kept.
    """
    hidden, head = final_hidden_states(model, input_ids, attention_mask)
    transform = logit_transform(model.config)
    return head_logprobs(head, transform, hidden, targets, lengths, budget_bytes=budget_bytes)


def head_logprobs(
    head: torch.nn.Module,
    transform: LogitTransform | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lengths: Sequence[int],
    *,
    budget_bytes: int = LOGITS_CHUNK_BYTES,
) -> torch.Tensor:
    """``chunked_target_logprobs`` from the final hidden states on: the head over each row's
    chunks (``row_chunks``), each recomputed in the backward when gradients are enabled; a
    request whose logits fit one chunk takes one chunk, kept for the backward (the same bits)."""
    chunk = chunk_positions(head, budget_bytes)
    if sum(lengths) <= chunk:
        return _one_chunk_logprobs(head, transform, hidden, targets, lengths)
    one_chunk = functools.partial(chunk_logprobs, head, transform)
    pieces = []
    for row, start, end in row_chunks(lengths, chunk):
        pieces.append(one_chunk(hidden[row, start:end], targets[row, start:end]))
    return torch.cat(pieces)


def _one_chunk_logprobs(
    head: torch.nn.Module,
    transform: LogitTransform | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lengths: Sequence[int],
) -> torch.Tensor:
    """``chunked_target_logprobs`` of a request whose logits fit one chunk: the head runs
    row by row, on the very rows the chunked path gives it (a matmul's bits depend on its
    shape), and the logit transform, gather and ``logsumexp``, each computed position by
    position, run once on every row's logits together."""
    rows = [row for row, length in enumerate(lengths) if length]
    states = [hidden[row, : lengths[row]] for row in rows]
    logits = _as_logits(transform, torch.cat([head(row_states) for row_states in states]))
    return _target_logprobs(logits, torch.cat([targets[row, : lengths[row]] for row in rows]))


def row_chunks(lengths: Sequence[int], chunk: int) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every chunk, in row order: each row cut from its first position
    into chunks of ``chunk`` positions, the last one shorter."""
    return [
        (row, start, min(start + chunk, length))
        for row, length in enumerate(lengths)
        for start in range(0, length, chunk)
    ]


def chunk_positions(head: torch.nn.Module, budget_bytes: int) -> int:
    """How many positions one chunk of this head's logits holds (``positions_per_chunk``)."""
    return positions_per_chunk(_vocab_size(head), budget_bytes)


def chunk_logprobs(
    head: Head,
    transform: LogitTransform | None,
    states: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """The logprobs of one chunk's targets; under non-reentrant checkpointing when gradients
    are enabled (its logits are freed once they exist and recomputed in the backward).
    ``head`` is the output head, or a function computing what it computes (several sessions'
    heads over a stack of their chunks: ``together.stacked_head``)."""
    if torch.is_grad_enabled():
        return checkpoint(_chunk_logprobs, head, transform, states, targets, use_reentrant=False)
    return _chunk_logprobs(head, transform, states, targets)


def final_hidden_states(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.nn.Module]:
    """The hidden states the model's head reads (after its final norm), ``(B, W, hidden)``, and
    that head, from one forward of the whole model that computes no logits."""
    head = model.get_output_embeddings()
    if head is None:
        raise FailedPrecondition(
            f"{type(model).__name__} has no output embeddings to compute token logprobs with"
        )
    kept: list[torch.Tensor] = []

    def keep_and_skip(_module: torch.nn.Module, args: tuple) -> tuple:
        kept.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(keep_and_skip)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        handle.remove()
    if len(kept) != 1:
        raise FailedPrecondition(
            f"{type(model).__name__} ran its output embeddings {len(kept)} times in one forward; "
            "token logprobs need exactly one"
        )
    return kept[0], head


def logit_transform(config: object) -> LogitTransform | None:
    """What the architecture's causal-LM forward does to the head's output before returning it
    as logits, in the same operations and order (so the same bits): Gemma's soft cap, Cohere's
    scale, Granite's divisor. None when it returns the head's output as it is."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divisor = getattr(config, "logits_scaling", None)
    if cap is not None:
        return lambda logits: torch.tanh(logits / cap) * cap
    if scale is not None:
        return lambda logits: logits * scale
    if divisor is not None:
        return lambda logits: logits / divisor
    return None


@dataclass(frozen=True)
class HeadScores:
    """What the head says at positions ``[start, length)`` of one row, in fp32: the target's
    logprob (``picked``, ``(n,)``), the ``k`` most likely ids best first with their logprobs
    (``top_ids``, ``top_logprobs``, ``(n, k)``), and the logprobs of the ids ``chosen`` named
    (``(n, m)``, 0.0 where it named -1)."""

    picked: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    chosen: torch.Tensor


@torch.no_grad()
def head_scores(
    head: torch.nn.Module,
    transform: LogitTransform | None,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    length: int,
    *,
    top_k: int = 0,
    chosen: torch.Tensor | None = None,
    start: int = 0,
    budget_bytes: int = LOGITS_CHUNK_BYTES,
) -> HeadScores:
    """``HeadScores`` of a batch of one row (a sample or a prompt scored alone) from positions
    ``start`` on, from its final hidden states ``(1, W, hidden)`` (``final_hidden_states``, of
    its forward alone or among other rows': ``together.sampling``); ``chosen`` is
    ``(length, m)`` ids, -1 for none. For reading only.

    The chunks are ``chunked_target_logprobs``' (cut from the row's first position, those wholly
    before ``start`` skipped), and every value is a logit minus its chunk's ``logsumexp``, as
    the target's logprob is there: so a top-k or chosen id's value is bit for bit what
    ``forward`` gives for that id as the target at that position. The top k is taken per chunk:
    ``[positions x vocabulary]`` is never held for more than one chunk.
    """
    chunk = positions_per_chunk(_vocab_size(head), budget_bytes)
    first = start - start % chunk
    pieces = [
        _chunk_scores(
            head,
            transform,
            hidden[0, begin : min(begin + chunk, length)],
            targets[0, begin : min(begin + chunk, length)],
            top_k,
            None if chosen is None else chosen[begin : min(begin + chunk, length)],
        )
        for begin in range(first, length, chunk)
    ]
    picked, top_ids, top_logprobs, alternatives = (
        torch.cat(parts)[start - first :] for parts in zip(*pieces, strict=True)
    )
    return HeadScores(picked, top_ids, top_logprobs, alternatives)


def _chunk_scores(
    head: torch.nn.Module,
    transform: LogitTransform | None,
    states: torch.Tensor,
    targets: torch.Tensor,
    top_k: int,
    chosen: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The same operations as ``_chunk_logprobs`` (the same bits for the target); the top k and
    # the chosen ids take their logits from that chunk and subtract the same logsumexp.
    logits = _chunk_logits(head, transform, states)
    normalizer = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    top_values, top_ids = logits.topk(top_k, dim=-1)
    top_logprobs = top_values - normalizer.unsqueeze(-1)
    if chosen is None:
        return picked, top_ids, top_logprobs, logits.new_zeros((len(states), 0))
    named = chosen >= 0
    values = logits.gather(-1, chosen.clamp(min=0)) - normalizer.unsqueeze(-1)
    return picked, top_ids, top_logprobs, torch.where(named, values, 0.0)


def _chunk_logprobs(
    head: Head,
    transform: LogitTransform | None,
    states: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    return _target_logprobs(_chunk_logits(head, transform, states), targets)


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # gather - logsumexp rather than a log_softmax: the same value without a second
    # chunk-by-vocabulary tensor.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_logits(
    head: Head, transform: LogitTransform | None, states: torch.Tensor
) -> torch.Tensor:
    """One chunk's logits in fp32, as the architecture's causal-LM forward returns them."""
    return _as_logits(transform, head(states))


def _as_logits(transform: LogitTransform | None, head_output: torch.Tensor) -> torch.Tensor:
    if transform is not None:
        head_output = transform(head_output)
    return head_output.float()


def _vocab_size(head: torch.nn.Module) -> int:
    """The head's output width: ``out_features`` (``nn.Linear`` and PEFT's LoRA layer keep it),
    else its weight's rows (a DTensor's shape is the whole one)."""
    width = getattr(head, "out_features", None)
    return int(width) if width else int(head.weight.shape[0])
