"""What the engine's operations return: plain dataclasses, no torch tensors inside.

A classifier's answer is the service's own ``Prediction`` (top label, scores in label order), so
nothing converts one into the other on the way out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwire.contract.outcomes import Prediction  # the one answer type the service also sends


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
