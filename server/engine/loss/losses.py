"""The token-level losses: plain functions over the current model's logprobs and their inputs.

Each takes ``logp`` (the model's log-probability of every target token of the batch, flattened
to one vector), the matching per-token ``TokenInputs`` and its resolved config, and returns each
token's term and their sum, the loss, with its metrics. The engine never branches on a loss name: it
looks the function up in ``LOSSES`` and calls it. With r = exp(logp - q):

- ``cross_entropy``        -sum(w * logp)
- ``importance_sampling``  -sum(r * A)
- ``ppo``                  -sum(min(r * A, clip(r, lo, hi) * A))
- ``cispo``                -sum(detach(clip(r, lo, hi)) * logp * A)
- ``dro``                  -sum(logp * A - beta / 2 * (logp - q) ** 2)
- ``gspo``                 -sum(min(s * A, clip(s, lo, hi) * A)), s = exp(m + logp - detach(logp)),
                           m the mean of detach(logp) - q over the example's masked targets

``gspo`` is GSPO-token as Tinker defines it: every token of an example carries that example's
sequence ratio (the geometric mean of r over the tokens its mask marks) as its value, and the
gradient of its own logp, so per-token advantages still work.

Tinker's ``stable_reinforce`` is refused with what to use instead (``NOT_SERVED``): it trains on
information a sampler records per sequence and datums name by their provenance, which this server
neither records nor reads.

Metric keys read ``name:reduction`` (``loss:sum``, ``ratio:mean``, ...), as Tinker writes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from trainwire.server.errors import InvalidArgument

CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
DRO_DEFAULTS = {"beta": 0.05}


@dataclass(frozen=True)
class TokenInputs:
    """Per-token loss inputs of a whole batch, flattened like ``logp``; None when not sent."""

    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None  # q: the sampling policy's logprobs
    advantages: torch.Tensor | None = None
    sequence_ratio_mask: torch.Tensor | None = None  # gspo: the tokens a sequence ratio covers
    lengths: tuple[int, ...] | None = None  # each example's token count (None: one example)


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # a scalar, the sum of ``elementwise``; backward runs on it
    metrics: dict[str, float] = field(default_factory=dict)
    elementwise: torch.Tensor | None = None  # each token's term (the Tinker SDK reports them)

    @classmethod
    def of(cls, terms: torch.Tensor, metrics: Mapping[str, float] | None = None) -> LossOutput:
        """The loss summed over every token's ``terms``, with ``loss:sum`` among its metrics."""
        loss = terms.sum()
        return cls(loss, {"loss:sum": float(loss.detach()), **(metrics or {})}, terms.detach())


LossFn = Callable[[torch.Tensor, TokenInputs, Mapping[str, float]], LossOutput]


def cross_entropy(logp: torch.Tensor, inputs: TokenInputs, config: Mapping[str, float]):
    weights = torch.ones_like(logp) if inputs.weights is None else inputs.weights
    return LossOutput.of(-(weights * logp))


def importance_sampling(logp: torch.Tensor, inputs: TokenInputs, config: Mapping[str, float]):
    ratio = torch.exp(logp - inputs.logprobs)
    return LossOutput.of(-(ratio * inputs.advantages), _ratio_metrics(ratio))


def ppo(logp: torch.Tensor, inputs: TokenInputs, config: Mapping[str, float]):
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio = torch.exp(logp - inputs.logprobs)
    advantages = inputs.advantages
    objective = torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    return LossOutput.of(-objective, _ratio_metrics(ratio, low, high))


def cispo(logp: torch.Tensor, inputs: TokenInputs, config: Mapping[str, float]):
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio = torch.exp(logp - inputs.logprobs)
    terms = -(torch.clamp(ratio, low, high).detach() * logp * inputs.advantages)
    return LossOutput.of(terms, _ratio_metrics(ratio, low, high))


def dro(logp: torch.Tensor, inputs: TokenInputs, config: Mapping[str, float]):
    beta = config["beta"]
    deviation = logp - inputs.logprobs
    terms = -(logp * inputs.advantages - beta / 2 * deviation**2)
    return LossOutput.of(terms, _ratio_metrics(torch.exp(deviation)))


def gspo(logp: torch.Tensor, inputs: TokenInputs, config: Mapping[str, float]):
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    log_ratio = logp.detach() - inputs.logprobs
    in_ratio = inputs.sequence_ratio_mask != 0
    lengths = list(inputs.lengths or (len(logp),))
    # One mean per example over the tokens its mask marks, spread over that example's tokens.
    sequence = torch.cat(
        [
            values[marked].mean().expand(len(values))
            for values, marked in zip(
                log_ratio.split(lengths), in_ratio.split(lengths), strict=True
            )
        ]
    )
    ratio = torch.exp(sequence + logp - logp.detach())
    advantages = inputs.advantages
    objective = torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
    return LossOutput.of(-objective, _ratio_metrics(ratio, low, high))


def _ratio_metrics(
    ratio: torch.Tensor, low: float | None = None, high: float | None = None
) -> dict[str, float]:
    ratio = ratio.detach()
    metrics = {"ratio:mean": float(ratio.mean()), "ratio:max": float(ratio.max())}
    if low is not None and high is not None:
        clipped = (ratio < low) | (ratio > high)
        metrics["clip_fraction:mean"] = float(clipped.float().mean())
    return metrics


@dataclass(frozen=True)
class LossSpec:
    """A loss function, the per-token inputs it needs and the config keys it takes."""

    fn: LossFn
    needs: tuple[str, ...] = ()
    defaults: Mapping[str, float] = field(default_factory=dict)


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages")),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), CLIP_DEFAULTS),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), CLIP_DEFAULTS),
    "dro": LossSpec(dro, ("logprobs", "advantages"), DRO_DEFAULTS),
    "gspo": LossSpec(gspo, ("logprobs", "advantages", "sequence_ratio_mask"), CLIP_DEFAULTS),
}

# Tinker losses this server does not serve, each with why and what to train with instead: the
# cookbook's RL recipes name one by default, so their users meet this first.
NOT_SERVED = {
    "stable_reinforce": (
        "loss_fn stable_reinforce is not served by this server: it needs stability information "
        "recorded when sampling, named by each datum's provenance, and this server records none; "
        "train with loss_fn ppo, cispo or gspo instead (the recipes' loss_fn option)"
    ),
}


def resolve_loss(
    name: str, config: Mapping[str, float] | None
) -> tuple[LossSpec, dict[str, float]]:
    """The loss ``name`` and its full config (defaults filled in), validated before any work.

    Raises ``InvalidArgument`` for an unknown loss, a key the loss does not take, a value that
    is not a finite number, or clip thresholds out of order.
    """
    if name in NOT_SERVED:
        raise InvalidArgument(NOT_SERVED[name])
    spec = LOSSES.get(name)
    if spec is None:
        raise InvalidArgument(f"unknown loss_fn {name!r}: use one of {', '.join(LOSSES)}")
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.defaults))
    if unknown:
        takes = ", ".join(spec.defaults) or "no keys"
        raise InvalidArgument(
            f"loss_fn_config for {name}: unknown key(s) {', '.join(unknown)}; {name} takes {takes}"
        )
    for key, value in given.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise InvalidArgument(f"loss_fn_config {key} must be a finite number, got {value!r}")
    resolved = {**spec.defaults, **{key: float(value) for key, value in given.items()}}
    if "clip_low_threshold" in resolved and not (
        0 <= resolved["clip_low_threshold"] <= resolved["clip_high_threshold"]
    ):
        raise InvalidArgument(
            "loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold, got "
            f"{resolved['clip_low_threshold']} and {resolved['clip_high_threshold']}"
        )
    return spec, resolved


def require_inputs(name: str, spec: LossSpec, examples: Sequence[object]) -> None:
    """InvalidArgument naming the first example that lacks an input ``name`` needs.

    Inputs a loss does not use (advantages under cross_entropy, say) are allowed and unused: a
    forward for a custom loss carries whatever that loss will need later.
    """
    for index, example in enumerate(examples):
        for needed in spec.needs:
            if getattr(example, needed) is None:
                raise InvalidArgument(
                    f"loss_fn {name} needs {needed} on every example; example {index} has none"
                )
        mask = getattr(example, "sequence_ratio_mask", None)
        if "sequence_ratio_mask" in spec.needs and not any(mask or ()):
            # The mean over no tokens is NaN: refused, never trained on.
            raise InvalidArgument(
                f"loss_fn {name}: example {index}'s sequence_ratio_mask marks no token; set it "
                "non-zero on the tokens its sequence ratio covers (the sampled ones)"
            )
