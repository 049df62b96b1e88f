"""Each target's loss (``elementwise_loss`` in the SDK's output), from the logprobs the engine
returned and the datum's inputs: the same formulas as ``trainwire.server.losses``, per token,
so their sum is the engine's ``loss:sum`` up to rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainwire.client.tokens import TokenExample


def elementwise_loss(
    loss_fn: str, config: Mapping[str, float], examples: Sequence[TokenExample], outcome: Any
) -> list[list[float]]:
    low = config.get("clip_low_threshold", 0.8)
    high = config.get("clip_high_threshold", 1.2)
    beta = config.get("beta", 0.05)
    rows = []
    for example, logprobs in zip(examples, outcome.logprobs, strict=True):
        logp = np.asarray(logprobs, dtype=np.float64)
        ones = np.ones_like(logp)
        weights = np.asarray(example.weights, dtype=np.float64) if example.weights else ones
        q = np.asarray(example.logprobs, dtype=np.float64) if example.logprobs else logp
        advantages = np.asarray(example.advantages) if example.advantages else ones * 0.0
        ratio = np.exp(logp - q)
        if loss_fn == "cross_entropy":
            loss = -weights * logp
        elif loss_fn == "importance_sampling":
            loss = -ratio * advantages
        elif loss_fn == "ppo":
            loss = -np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages)
        elif loss_fn == "cispo":
            loss = -np.clip(ratio, low, high) * logp * advantages
        elif loss_fn == "dro":
            loss = -(logp * advantages - beta / 2 * (logp - q) ** 2)
        else:
            loss = np.zeros_like(logp)
        rows.append(loss.tolist())
    return rows
