"""Token examples to tensors, and the one function that turns a model into target logprobs.

Every path that reports or trains on token logprobs (forward, forward_backward, the sampler's
recomputation) goes through ``token_logprobs`` on a batch built by ``encode_token_batch``, so a
sample's logprobs and a later forward of that sample alone are the same bits. The logprobs are
computed in chunks of positions (``chunked_logprobs``), never over the whole vocabulary for every
token at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainwire.contract.tokens import FLOAT_FIELDS, TokenExample
from trainwire.server.engine.loss.chunked_logprobs import (
    LOGITS_CHUNK_BYTES,
    chunked_target_logprobs,
)
from trainwire.server.engine.loss.losses import TokenInputs
from trainwire.server.errors import InvalidArgument


@dataclass
class TokenBatch:
    """A right-padded token batch on the session's device.

    ``mask`` marks the real positions; ``inputs`` holds the per-token loss inputs of those
    positions only, flattened in example order, like ``target_logprobs(...)[mask]``.
    """

    input_ids: torch.Tensor  # (B, W) long
    attention_mask: torch.Tensor  # (B, W) long
    targets: torch.Tensor  # (B, W) long, 0 on padding
    mask: torch.Tensor  # (B, W) bool
    lengths: list[int]
    inputs: TokenInputs
    # What one chunk of logits may take (``chunked_logprobs``): the session's, fixed for a run.
    logits_chunk_bytes: int = LOGITS_CHUNK_BYTES

    @property
    def token_count(self) -> int:
        return sum(self.lengths)

    def split(self, flat: torch.Tensor) -> list[list[float]]:
        """A flat per-token tensor back into one list per example."""
        values = flat.detach().float().cpu().tolist()
        out, start = [], 0
        for length in self.lengths:
            out.append(values[start : start + length])
            start += length
        return out


def _how_to_fit(max_length: int, model_positions: int | None) -> str:
    if model_positions is None:
        return "shorten it or raise max_length"
    if max_length >= model_positions:
        return f"shorten it (the model has {model_positions} positions)"
    return f"shorten it or raise max_length (up to the model's {model_positions} positions)"


def encode_token_batch(
    examples: Sequence[TokenExample],
    *,
    vocab_size: int,
    max_length: int,
    pad_id: int,
    device: torch.device,
    logits_chunk_bytes: int = LOGITS_CHUNK_BYTES,
    model_positions: int | None = None,
) -> TokenBatch:
    """Validate token examples against the model and pad them into one batch.

    Raises ``InvalidArgument`` naming the example and the position: an id outside the
    vocabulary, or a sequence longer than ``max_length`` (never cut: a cut sequence would train
    on other targets than the caller sent; where ``max_length`` is the model's
    ``model_positions`` already, the message does not suggest raising it).
    """
    if not examples:
        raise InvalidArgument("empty batch: send at least one example")
    for index, example in enumerate(examples):
        if not isinstance(example, TokenExample):
            raise InvalidArgument(f"example {index} is not a TokenExample")
        if len(example) > max_length:
            raise InvalidArgument(
                f"example {index}: {len(example)} tokens is over max_length {max_length}; "
                + _how_to_fit(max_length, model_positions)
            )
        for name in ("tokens", "target_tokens"):
            ids = getattr(example, name)
            top = max(ids)
            if top >= vocab_size:
                raise InvalidArgument(
                    f"example {index}: {name}[{ids.index(top)}] = {top} is outside the model's "
                    f"vocabulary of {vocab_size} ids"
                )
    lengths = [len(example) for example in examples]
    width = max(lengths)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, example in enumerate(examples):
        input_ids[row, : len(example)] = torch.tensor(example.tokens)
        targets[row, : len(example)] = torch.tensor(example.target_tokens)
        mask[row, : len(example)] = True
    inputs = flat_inputs(examples, device)
    return TokenBatch(
        input_ids=input_ids.to(device),
        attention_mask=mask.long().to(device),
        targets=targets.to(device),
        mask=mask.to(device),
        lengths=lengths,
        inputs=inputs,
        logits_chunk_bytes=logits_chunk_bytes,
    )


def token_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """log p(target) of every real position, flat in ``batch.mask`` order, in fp32."""
    return chunked_target_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.targets,
        batch.lengths,
        budget_bytes=batch.logits_chunk_bytes,
    )


def target_logprobs(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """``token_logprobs`` laid out as the batch, (B, W); padding positions hold 0."""
    flat = token_logprobs(model, batch)
    return flat.new_zeros(batch.mask.shape).masked_scatter(batch.mask, flat)


def flat_inputs(examples: Sequence[TokenExample], device: torch.device) -> TokenInputs:
    """The loss inputs of ``examples``, flat like the batch's logprobs, with each example's
    length (what a loss reads; ``service.loss_terms`` reads the same for its terms)."""
    lengths = tuple(len(example) for example in examples)
    return TokenInputs(
        **{name: _flat(examples, name, device) for name in FLOAT_FIELDS}, lengths=lengths
    )


def _flat(examples: Sequence[TokenExample], name: str, device: torch.device):
    """One field of every example, concatenated. Weights an example leaves out are 1.0; the
    other fields are None unless every example sets them (the loss checked what it needs)."""
    values = [getattr(example, name) for example in examples]
    if all(value is None for value in values):
        return None
    if any(value is None for value in values):
        if name != "weights":
            return None
        values = [
            (1.0,) * len(e) if v is None else v for e, v in zip(examples, values, strict=True)
        ]
    return float32_rows(values).to(device)


def float32_rows(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    """``rows`` concatenated as one float32 tensor, each value rounded as ``torch.tensor``
    rounds it (to nearest): a row at a time through NumPy, four times faster than one Python
    list of every value."""
    if not rows:
        return torch.zeros(0, dtype=torch.float32)
    return torch.from_numpy(np.concatenate([np.asarray(row, dtype=np.float32) for row in rows]))
