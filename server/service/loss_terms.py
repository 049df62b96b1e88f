"""Each target's term of a loss (the Tinker SDK's ``elementwise_loss`` output), from the logprobs
an operation returned and the examples' inputs, through the engine's own loss table
(``trainwire.server.engine.loss.losses``): the same terms, token by token, whose sum is
``loss:sum``.

Pure arithmetic on a finished outcome, so a transport computes it after the engine call (the Tinker
front does, while the next call runs); it lives in the service so that no transport reaches
into the engine's modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.loss.losses import TokenInputs, resolve_loss


def elementwise_loss(
    loss_fn: str, config: Mapping[str, float], examples: Sequence[TokenExample], outcome: Any
) -> list[list[float]]:
    """One row per example: each target's term of ``loss_fn`` at the returned logprobs (the
    engine checked the inputs the loss needs before it ran)."""
    spec, resolved = resolve_loss(loss_fn, config)
    rows = []
    for example, logprobs in zip(examples, outcome.logprobs, strict=True):
        inputs = TokenInputs(
            weights=_tensor(example.weights),
            logprobs=_tensor(example.logprobs),
            advantages=_tensor(example.advantages),
            sequence_ratio_mask=_tensor(example.sequence_ratio_mask),
        )
        terms = spec.fn(torch.tensor(logprobs, dtype=torch.float32), inputs, resolved).elementwise
        rows.append(terms.tolist())
    return rows


def _tensor(values: Sequence[float] | None) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.float32)
