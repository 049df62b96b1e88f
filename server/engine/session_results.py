"""What the engine's operations return: plain dataclasses, no torch tensors inside."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Prediction:
    """A classifier's answer for one example: the top label and the scores in label order."""

    label: str
    scores: list[float]


@dataclass
class ForwardResult:
    loss: float
    predictions: list[Prediction] = field(default_factory=list)


@dataclass
class StepResult:
    step: int  # updates applied, this one included
    learning_rate: float  # the rate this update used
    grad_norm: float  # the global gradient norm before clipping


@dataclass
class TokenOutput:
    """A token batch's result: the summed loss, each example's target logprobs (computed before
    any update this call makes) and the loss's metrics, keyed ``name:reduction``."""

    loss: float
    logprobs: list[list[float]]
    metrics: dict[str, float] = field(default_factory=dict)
