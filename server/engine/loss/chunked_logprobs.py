"""Target logprobs without ever holding ``[tokens x vocabulary]``: the head runs over chunks.

Every token logprob the engine computes (every loss, ``forward``, prompt logprobs and the
logprobs a sample reports) comes from ``chunked_target_logprobs``. The model runs once for its
final hidden states: a pre-hook on its output embeddings keeps their input and hands the head
zero positions, so the model's own forward (FSDP's gathering, PEFT's adapters, gradient
checkpointing) runs as it always would, and computes no logits. Then the head (the real module,
LoRA on the unembedding included), the architecture's logit transform, ``logsumexp`` and the
gathered target run over chunks of positions, each chunk under non-reentrant checkpointing: its
logits are freed once its logprobs exist and recomputed in the backward, one chunk at a time.

Chunks never cross an example: each row of a batch is cut into chunks from its first position,
so an example's chunks are the same alone and in any company, and the sampler, which scores a
sample alone, runs the very shapes ``forward`` of that sample runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

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

    Recorded for backward when gradients are enabled (the chunks are recomputed there); under
    ``torch.no_grad`` nothing is kept.
    """
    hidden, head = final_hidden_states(model, input_ids, attention_mask)
    transform = logit_transform(model.config)
    chunk = positions_per_chunk(_vocab_size(head), budget_bytes)
    one_chunk = functools.partial(_chunk_logprobs, head, transform)
    recompute = torch.is_grad_enabled()
    pieces = []
    for row, length in enumerate(lengths):
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            states, picked = hidden[row, start:end], targets[row, start:end]
            if recompute:
                pieces.append(checkpoint(one_chunk, states, picked, use_reentrant=False))
            else:
                pieces.append(one_chunk(states, picked))
    return torch.cat(pieces)


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


def _chunk_logprobs(
    head: torch.nn.Module,
    transform: LogitTransform | None,
    states: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    # gather - logsumexp rather than a log_softmax: the same value without a second
    # chunk-by-vocabulary tensor.
    logits = head(states)
    if transform is not None:
        logits = transform(logits)
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _vocab_size(head: torch.nn.Module) -> int:
    """The head's output width: ``out_features`` (``nn.Linear`` and PEFT's LoRA layer keep it),
    else its weight's rows (a DTensor's shape is the whole one)."""
    width = getattr(head, "out_features", None)
    return int(width) if width else int(head.weight.shape[0])
