"""One encoded microbatch, text or tokens, behind one interface the engine drives.

The engine's forward and forward_backward read the same whatever the batch holds: encode, run
``loss`` under the right mode, then ``backward_result`` or ``forward_result``. Text batches run
their task's native loss (causal-lm: cross-entropy over the chunked logprobs; classification: the
model's own); token batches run a named loss over logprobs. Both go through the loss hook, and
the engine never looks at a loss name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutput

from trainwire.contract.config import TrainingConfig
from trainwire.contract.outcomes import Prediction
from trainwire.contract.tokens import DEFAULT_LOSS, is_token_batch
from trainwire.server.engine.loss.batching import Batch, BatchEncoder
from trainwire.server.engine.loss.loss_hook import LossHook, causal_lm_mean, causal_lm_targets
from trainwire.server.engine.loss.losses import LossSpec, require_inputs, resolve_loss
from trainwire.server.engine.loss.token_batches import TokenBatch, encode_token_batch
from trainwire.server.engine.session.results import ForwardResult, TokenOutput
from trainwire.server.errors import InvalidArgument


@dataclass
class TextMicrobatch:
    """Text examples, encoded by the session's ``BatchEncoder``."""

    batch: Batch
    config: TrainingConfig
    _output: Any = None

    @property
    def token_count(self) -> int:
        return self.batch.token_count

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``: what the model's forward reads."""
        return self.batch.inputs["input_ids"], self.batch.inputs["attention_mask"]

    def loss(self, model: torch.nn.Module, hook: LossHook, *, training: bool) -> torch.Tensor:
        self._output = hook.compute_loss(model, self.batch, training=training)
        return self._output.loss

    def head_targets(self) -> tuple[torch.Tensor, list[int]]:
        """What the default hook's causal-lm loss scores: targets and each row's length."""
        targets, lengths = causal_lm_targets(self.batch)
        return targets.clamp(min=0), lengths  # an ignored position is scored, never counted

    def loss_of_logprobs(self, logp: torch.Tensor) -> torch.Tensor:
        """The default hook's causal-lm loss from the logprobs of ``head_targets``."""
        loss = causal_lm_mean(logp, *causal_lm_targets(self.batch))
        self._output = CausalLMOutput(loss=loss)
        return loss

    def forward_result(self, loss: torch.Tensor) -> ForwardResult:
        predictions = []
        if self.config.task == "sequence-classification":
            for row in self._output.logits.float().cpu():
                top = int(torch.argmax(row))
                predictions.append(Prediction(self.config.labels[top], tuple(row.tolist())))
        return ForwardResult(float(loss.item()), predictions)

    def backward_result(self, loss: torch.Tensor) -> float:
        return float(loss.item())


@dataclass
class TokenMicrobatch:
    """Token examples with the loss they train on."""

    batch: TokenBatch
    spec: LossSpec
    loss_config: dict[str, float]
    _metrics: dict[str, float] = field(default_factory=dict)
    _logprobs: list[list[float]] = field(default_factory=list)

    @property
    def token_count(self) -> int:
        return self.batch.token_count

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)``: what the model's forward reads."""
        return self.batch.input_ids, self.batch.attention_mask

    def loss(self, model: torch.nn.Module, hook: LossHook, *, training: bool) -> torch.Tensor:
        output, logp = hook.compute_token_loss(
            model, self.batch, self.spec, self.loss_config, training=training
        )
        self._metrics, self._logprobs = output.metrics, self.batch.split(logp)
        return output.loss

    def head_targets(self) -> tuple[torch.Tensor, list[int]]:
        """The targets the loss scores and each row's length."""
        return self.batch.targets, self.batch.lengths

    def loss_of_logprobs(self, logp: torch.Tensor) -> torch.Tensor:
        """The default hook's loss from the logprobs of ``head_targets``."""
        output = self.spec.fn(logp, self.batch.inputs, self.loss_config)
        self._metrics, self._logprobs = output.metrics, self.batch.split(logp)
        return output.loss

    def forward_result(self, loss: torch.Tensor) -> TokenOutput:
        return TokenOutput(float(loss.detach().item()), self._logprobs, dict(self._metrics))

    backward_result = forward_result


Microbatch = TextMicrobatch | TokenMicrobatch


def encode_microbatch(
    examples: Sequence[Any],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    *,
    encoder: BatchEncoder,
    vocab_size: int,
) -> Microbatch:
    """Validate and encode a batch of either kind; InvalidArgument before any model work."""
    if not examples:
        raise InvalidArgument("empty batch: send at least one example")
    try:
        tokens = is_token_batch(examples)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None
    config = encoder.config
    if not tokens:
        if loss_fn != DEFAULT_LOSS or loss_fn_config:
            raise InvalidArgument(
                f"text examples train with their task's native loss; loss_fn {loss_fn!r} and "
                "loss_fn_config need token examples (TokenExample)"
            )
        return TextMicrobatch(encoder.encode(examples), config)
    if config.task != "causal-lm":
        raise InvalidArgument(f"token examples need a causal-lm session; this one is {config.task}")
    spec, resolved = resolve_loss(loss_fn, loss_fn_config)
    require_inputs(loss_fn, spec, examples)
    batch = encode_token_batch(
        examples,
        vocab_size=vocab_size,
        max_length=encoder.max_length,
        pad_id=encoder.pad_id,
        device=encoder.device,
        logits_chunk_bytes=encoder.logits_chunk_bytes,
        model_positions=encoder.model_positions,
    )
    return TokenMicrobatch(batch, spec, resolved)
