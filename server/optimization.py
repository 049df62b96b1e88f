"""AdamW parameter groups and the learning-rate schedule.

The schedule is a pure function of the step, set on the optimizer before each update, so its
whole state is the step counter: nothing to pickle, nothing to drift between a run and its resume.
"""

from __future__ import annotations

import math

import torch

from trainwire.client.config import TrainingConfig


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

    Matches Hugging Face's ``get_{linear,cosine,constant}_schedule_with_warmup``.
    """
    base = config.learning_rate
    warmup = config.warmup_steps
    if step < warmup:
        return base * step / max(1, warmup)
    if config.lr_scheduler == "constant":
        return base
    if max_steps is None:
        raise ValueError(
            f"lr_scheduler {config.lr_scheduler!r} decays over max_steps; open the session "
            "with max_steps (the plan's max_steps), or use lr_scheduler 'constant'"
        )
    remaining = max(0, max_steps - step)
    span = max(1, max_steps - warmup)
    if config.lr_scheduler == "linear":
        return base * remaining / span
    progress = (step - warmup) / span
    return base * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
