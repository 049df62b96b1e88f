"""AdamW parameter groups and the learning-rate schedule.

The schedule is a pure function of the step, set on the optimizer before each update, so its
whole state is the step counter: nothing to pickle, nothing to drift between a run and its resume.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from trainwire.contract.config import TrainingConfig
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
    """AdamW over the model's trainable parameters, in its multi-tensor (``foreach``) form on
    every device: a LoRA adapter is dozens of small tensors, and one kernel call per step for
    all of them, rather than seven per tensor, is most of what an update costs on a CPU beside
    other threads (each call gives up and takes back the interpreter lock). On the CPU it gives
    the per-tensor loop's bits (the same elementwise operations in the same order), which
    ``tests/test_optimizer_forms.py`` checks."""
    return torch.optim.AdamW(
        parameter_groups(model, config.weight_decay),
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        foreach=True,
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


@dataclass(frozen=True)
class UpdateSettings:
    """Settings one update uses in place of the run's; None keeps the run's.

    ``learning_rate`` replaces the schedule's rate (the schedule still advances); ``beta1``,
    ``beta2``, ``eps`` and ``weight_decay`` are AdamW's for this update only (weight decay
    applies where the run's does: matrices, never biases or norms); ``max_grad_norm`` clips at
    that norm, 0 meaning no clipping for this update.
    """

    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None

    def check(self) -> None:
        """InvalidArgument naming every value that no AdamW update can use."""
        problems = [
            _problem("learning_rate", self.learning_rate, "a finite number >= 0", _at_least(0)),
            _problem("beta1", self.beta1, "in [0, 1)", _below_one),
            _problem("beta2", self.beta2, "in [0, 1)", _below_one),
            _problem("eps", self.eps, "a finite number > 0", _positive),
            _problem("weight_decay", self.weight_decay, "a finite number >= 0", _at_least(0)),
            _problem("max_grad_norm", self.max_grad_norm, "a finite number >= 0", _at_least(0)),
        ]
        problems = [problem for problem in problems if problem]
        if problems:
            raise InvalidArgument("; ".join(problems))


def _problem(name: str, value: object, wanted: str, fits: Callable[[float], bool]) -> str:
    if value is None:
        return ""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and math.isfinite(value) and fits(float(value)):  # type: ignore[arg-type]
        return ""
    return f"{name} must be {wanted}, got {value!r}"


def _at_least(bound: float) -> Callable[[float], bool]:
    return lambda value: value >= bound


def _below_one(value: float) -> bool:
    return 0.0 <= value < 1.0


def _positive(value: float) -> bool:
    return value > 0.0


def apply_update(
    optimizer: torch.optim.Optimizer,
    parameters: list[torch.Tensor],
    *,
    accumulated: int,
    max_grad_norm: float | None,
    rate: float,
    settings: UpdateSettings = UpdateSettings(),
    total_norm: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
) -> float:
    """One AdamW update at ``rate`` from the pending gradients; returns their norm before clipping.

    The gradients of ``accumulated`` microbatches are averaged first, so a partial accumulation
    is normalized by the microbatches it really holds. ``settings`` replace the run's AdamW
    settings for this update; the run's are back in the optimizer afterwards, whatever happens.
    ``total_norm`` computes the norm where the gradients are shards (``sharding.total_norm``);
    None is the single-process norm.
    """
    with_grads = [p for p in parameters if p.grad is not None]
    if accumulated > 1:
        for parameter in with_grads:
            parameter.grad.div_(accumulated)
    if settings.max_grad_norm is not None:
        max_grad_norm = settings.max_grad_norm or None  # 0: no clipping for this update
    if total_norm is not None:
        norm = total_norm([p.grad for p in with_grads])
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_grad_norm, norm)
    elif max_grad_norm is None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads])
    else:
        norm = torch.nn.utils.clip_grad_norm_(with_grads, max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = rate
    with _adam_settings(optimizer, settings):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


@contextlib.contextmanager
def _adam_settings(optimizer: torch.optim.Optimizer, settings: UpdateSettings) -> Iterator[None]:
    """The optimizer with ``settings``' betas, eps and weight decay for the block. The first
    group is the one that decays (``parameter_groups``); the second never does."""
    groups = optimizer.param_groups
    saved = [(g["betas"], g["eps"], g["weight_decay"]) for g in groups]
    try:
        for index, group in enumerate(groups):
            beta1, beta2 = group["betas"]
            group["betas"] = (_given(settings.beta1, beta1), _given(settings.beta2, beta2))
            group["eps"] = _given(settings.eps, group["eps"])
            if index == 0:
                group["weight_decay"] = _given(settings.weight_decay, group["weight_decay"])
        yield
    finally:
        for group, (betas, eps, weight_decay) in zip(groups, saved, strict=True):
            group["betas"], group["eps"], group["weight_decay"] = betas, eps, weight_decay


def _given(value: float | None, default: float) -> float:
    return default if value is None else float(value)
