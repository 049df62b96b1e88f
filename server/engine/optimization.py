"""AdamW parameter groups and the learning-rate schedule.

The schedule is a pure function of the step, set on the optimizer before each update, so its
whole state is the step counter: nothing to pickle, nothing to drift between a run and its resume.
"""

from __future__ import annotations

import math

import torch

from trainwire.client.config import TrainingConfig
from trainwire.server.errors import InvalidArgument


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Trainable parameters in two AdamW groups: matrices decay, vectors (biases, norms) do not."""
    decay, no_decay = [], []
    for _, parameter in model.named_parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, config: TrainingConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        parameter_groups(model, config.weight_decay),
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
    )


def learning_rate_at(step: int, config: TrainingConfig, max_steps: int | None) -> float:
    """The learning rate of update ``step`` (0-based): linear warmup, then the configured decay.

    Bit for bit Hugging Face's ``get_{linear,cosine,constant}_schedule_with_warmup`` (the base
    rate times the factor, computed as they compute it). Without ``max_steps`` there is no
    horizon to decay over: the rate holds at ``learning_rate`` after warmup (the session warns).
    """
    base = config.learning_rate
    warmup = config.warmup_steps
    if step < warmup:
        return base * (float(step) / float(max(1, warmup)))
    if config.lr_scheduler == "constant" or max_steps is None:
        return base * 1.0
    remaining = max_steps - step
    span = max(1, max_steps - warmup)
    if config.lr_scheduler == "linear":
        return base * max(0.0, float(remaining) / float(span))
    progress = float(step - warmup) / float(span)
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def check_learning_rate(rate: float | None) -> None:
    """InvalidArgument unless ``rate`` is None (the schedule's) or a finite number >= 0."""
    if rate is None:
        return
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
        raise InvalidArgument(f"learning_rate must be a finite number, got {rate!r}")
    if rate < 0:
        raise InvalidArgument(f"learning_rate must be >= 0, got {rate}")


def apply_update(
    optimizer: torch.optim.Optimizer,
    parameters: list[torch.Tensor],
    *,
    accumulated: int,
    max_grad_norm: float | None,
    rate: float,
) -> float:
    """One AdamW update at ``rate`` from the pending gradients; returns their norm before clipping.

    The gradients of ``accumulated`` microbatches are averaged first, so a partial accumulation
    is normalized by the microbatches it really holds.
    """
    with_grads = [p for p in parameters if p.grad is not None]
    if accumulated > 1:
        for parameter in with_grads:
            parameter.grad.div_(accumulated)
    if max_grad_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads])
    else:
        norm = torch.nn.utils.clip_grad_norm_(with_grads, max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = rate
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
