"""The output head over many sessions' rows at once, each row's logprobs as its session alone.

Alone, a session runs its head over each row's chunks (``loss.chunked_logprobs``: chunks never
cross a row, so an example's chunks are the same in any company). Here the chunks of every
session's rows are packed whole, in order, into stacks of at most one chunk's positions (the
logits budget holds as alone), and each stack runs the head once. A chunk's logits, logsumexp
and gathered target are its rows' own, so where the device gives a row the same bits alone and
stacked (``row_invariance``, which probes the head's shape too) each logprob is the bits of its
chunk alone. A chunk under the probe's ``min_rows`` runs on its own, as alone.

A session's head may carry a LoRA adapter (Tinker's ``train_unembed``). A stack then runs the
base's head once over its rows and adds to each chunk its own session's adapter, as that
session's head adds it alone (``row_blocks.by_row_block``): the adapter's products run on that
chunk's rows only, in the shapes they take alone (one chunk each), so its logprobs and the
adapter's gradients are its own. A chunk that runs on its own runs its session's whole head.
Each stack is recomputed in the backward, as each chunk alone is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainwire.server.engine.loss.chunked_logprobs import (
    LogitTransform,
    chunk_logprobs,
    chunk_positions,
    row_chunks,
)
from trainwire.server.engine.together.row_blocks import by_row_block, row_adapter


@dataclass(frozen=True)
class HeadRows:
    """One session's part: its own output head (a LoRA layer where it trains one), its final
    hidden states ``(B, W, hidden)``, the target of each position ``(B, W)`` and how many
    positions of each row are scored."""

    head: torch.nn.Module
    hidden: torch.Tensor
    targets: torch.Tensor
    lengths: Sequence[int]


@dataclass(frozen=True)
class _Chunk:
    part: int  # which HeadRows
    slot: int  # its place among that part's chunks
    head: torch.nn.Module  # its session's own
    states: torch.Tensor
    targets: torch.Tensor


def stacked_logprobs(
    base_head: torch.nn.Module,
    transform: LogitTransform | None,
    parts: Sequence[HeadRows],
    *,
    budget_bytes: int,
    min_rows: int,
    max_rows: int,
) -> list[torch.Tensor]:
    """Each part's flat logprobs, in its row order, as ``head_logprobs`` of its own head gives
    them alone; ``base_head`` is the shared base's output head (``row_blocks.base_layer``)."""
    positions = chunk_positions(base_head, budget_bytes)
    stack_rows = min(positions, max_rows)
    slots: list[list[torch.Tensor | None]] = []
    stack: list[_Chunk] = []
    for index, part in enumerate(parts):
        chunks = row_chunks(part.lengths, positions)
        slots.append([None] * len(chunks))
        for slot, (row, start, end) in enumerate(chunks):
            states, targets = part.hidden[row, start:end], part.targets[row, start:end]
            if end - start < min_rows:  # too few rows to share a product bit for bit
                slots[index][slot] = chunk_logprobs(part.head, transform, states, targets)
                continue
            if sum(len(c.states) for c in stack) + len(states) > stack_rows:
                _run(base_head, transform, stack, slots)
                stack = []
            stack.append(_Chunk(index, slot, part.head, states, targets))
    _run(base_head, transform, stack, slots)
    return [torch.cat(pieces) for pieces in slots]


def _run(
    base_head: torch.nn.Module,
    transform: LogitTransform | None,
    stack: list[_Chunk],
    slots: list[list[torch.Tensor | None]],
) -> None:
    if not stack:
        return
    states = torch.cat([chunk.states for chunk in stack])
    targets = torch.cat([chunk.targets for chunk in stack])
    sizes = [len(chunk.states) for chunk in stack]
    adapters = [row_adapter(chunk.head) for chunk in stack]
    heads = functools.partial(by_row_block, base_head, adapters, sizes)
    logp = chunk_logprobs(heads, transform, states, targets)
    # Split, not sliced: the backward of a split is one concatenation, no zeros added in.
    for chunk, piece in zip(stack, logp.split(sizes), strict=True):
        slots[chunk.part][chunk.slot] = piece
