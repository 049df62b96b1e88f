"""The loss hook: the per-batch math a session runs, the one place to customize the loss.

Not a trainer: the session keeps the one optimizer loop (and Lightning's ``Trainer`` drives the
session in local runs). A hook only turns a batch into the output whose ``.loss`` backward runs
on, and may keep state that must resume exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutput

from trainwire.contract.config import TrainingConfig
from trainwire.server.engine.loss.batching import IGNORE_INDEX, Batch
from trainwire.server.engine.loss.chunked_logprobs import chunked_target_logprobs
from trainwire.server.engine.loss.losses import LossOutput, LossSpec
from trainwire.server.engine.loss.token_batches import TokenBatch, token_logprobs
from trainwire.server.errors import InvalidArgument


class LossHook:
    """The per-batch math of a session; subclass it for a custom loss or extra state.

    A subclass's ``session_state_dict()`` rides in the session checkpoint and the state digest,
    so state it keeps (a recovery buffer, say) resumes exactly.
    """

    def __init__(self, config: TrainingConfig) -> None:
        self.config = config

    def compute_loss(self, model: torch.nn.Module, batch: Batch, *, training: bool) -> Any:
        """The model's output for ``batch``; its ``.loss`` is what backward runs on.

        Causal-lm batches return a ``CausalLMOutput`` holding only the loss, computed on the
        chunked path (``causal_lm_loss``); classification returns the model's own output, whose
        logits are one row of labels per example.
        ``training`` is False under ``forward``, which must leave the hook's state alone.
        """
        if self.config.task == "causal-lm":
            return CausalLMOutput(loss=causal_lm_loss(model, batch))
        return model(**batch.inputs)

    def compute_token_loss(
        self,
        model: torch.nn.Module,
        batch: TokenBatch,
        loss: LossSpec,
        config: Mapping[str, float],
        *,
        training: bool,
    ) -> tuple[LossOutput, torch.Tensor]:
        """A token batch's loss and the flat logprobs of its targets (``batch.mask`` order).

        The default runs the named loss function (``trainwire.server.engine.loss.losses``) on the
        model's logprobs; a subclass may add terms or state, as ``compute_loss`` may for text.
        """
        logp = token_logprobs(model, batch)
        return loss.fn(logp, batch.inputs, config), logp

    def session_state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_session_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise InvalidArgument(
                f"the checkpoint holds trainer state ({', '.join(sorted(state))}) that "
                f"{type(self).__name__} does not keep"
            )


LossHookFactory = Callable[[TrainingConfig], LossHook]


def causal_lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """A text batch's causal-lm loss as transformers' ``ForCausalLMLoss`` defines it: position
    ``t`` predicts label ``t + 1``, and the loss is the mean negative logprob over the labels
    that are not ``IGNORE_INDEX``, so a session's microbatch and accumulation normalization stay
    what they are. The logprobs come from ``chunked_target_logprobs``, the path token losses
    and the sampler take, so a long text never holds ``[tokens x vocabulary]``.
    """
    targets, lengths = causal_lm_targets(batch)
    logp = chunked_target_logprobs(
        model,
        batch.inputs["input_ids"],
        batch.inputs["attention_mask"],
        targets.clamp(min=0),  # an ignored position scores some id; it is not counted below
        lengths,
        budget_bytes=batch.logits_chunk_bytes,
    )
    return causal_lm_mean(logp, targets, lengths)


def causal_lm_targets(batch: Batch) -> tuple[torch.Tensor, list[int]]:
    """A text batch's targets (label ``t + 1`` at position ``t``, ``IGNORE_INDEX`` where not
    counted) and how many positions of each row score one."""
    # Right-padded: a row's last real position predicts nothing, and no padding position
    # carries a label, so each row's first length - 1 positions hold every counted target.
    lengths = [max(int(n) - 1, 0) for n in batch.inputs["attention_mask"].sum(dim=1).tolist()]
    return batch.inputs["labels"][:, 1:], lengths


def causal_lm_mean(logp: torch.Tensor, targets: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The mean negative logprob over the counted targets, from the logprobs of every scored
    position (``causal_lm_targets``' lengths, in row order)."""
    counted = targets != IGNORE_INDEX
    keep = torch.cat([counted[row, :length] for row, length in enumerate(lengths)])
    return -logp[keep].sum() / keep.sum()
