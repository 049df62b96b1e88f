"""Custom losses computed on the caller's side, applied on the server as weighted cross-entropy.

``forward_backward_custom`` runs a ``forward`` to get every target's logprob, evaluates the
caller's torch loss on them, and sends one ``cross_entropy`` ``forward_backward`` whose weights
are minus the loss's gradient with respect to each logprob. The server's update is then exactly
the gradient of the custom loss (through the logprobs), with the usual exactly-once key.

torch is imported only when the function is called: ``trainwire.client`` stays torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from trainwire.contract.tokens import TokenExample

if TYPE_CHECKING:
    import torch

    from trainwire.client.session.session_client import SessionClient
    from trainwire.contract.outcomes import ForwardBackwardOutcome

CustomLoss = Callable[[list["torch.Tensor"]], "torch.Tensor"]


def forward_backward_custom(
    client: SessionClient,
    examples: Sequence[TokenExample],
    loss_fn: CustomLoss,
    *,
    operation_key: str,
    **forward_backward_options: Any,
) -> ForwardBackwardOutcome:
    """Train on ``loss_fn(logprobs)``, a torch scalar of one fp32 tensor of logprobs per example.

    The outcome is the server's ``forward_backward`` one, with ``custom_loss:sum`` (the value
    of ``loss_fn``) added to its metrics. The forward sees the weights as they are now: call it
    once per key (its own retries are exactly-once; a second call after the update landed sends
    other weights under the same key, which the server refuses as ALREADY_EXISTS).
    """
    import torch

    forward = client.forward(examples)
    logprobs = [
        torch.tensor(row, dtype=torch.float32, requires_grad=True) for row in forward.logprobs
    ]
    loss = loss_fn(logprobs)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError("the custom loss must return a scalar torch tensor")
    loss.backward()
    weighted = [
        dataclasses.replace(example, weights=_minus_gradient(row, len(example)))
        for example, row in zip(examples, logprobs, strict=True)
    ]
    outcome = client.forward_backward(
        weighted, operation_key=operation_key, **forward_backward_options
    )
    metrics = {**outcome.metrics, "custom_loss:sum": float(loss.detach())}
    return dataclasses.replace(outcome, metrics=metrics)


def _minus_gradient(row: torch.Tensor, length: int) -> tuple[float, ...]:
    """-d loss / d logprob for each target (0.0 where the loss does not use a position)."""
    if row.grad is None:
        return (0.0,) * length
    return tuple((-row.grad).tolist())
