"""Keyed operations on a session host, as the host tests send them (the fixtures that make the
hosts, ``make_host`` and ``host``, are in conftest.py)."""

from __future__ import annotations

from service_fixtures import TEXTS, microbatches

from trainwire.contract.outcomes import OperationSpec
from trainwire.server.service import operations as ops
from trainwire.server.service.host import SessionHost
from trainwire.server.service.requests import ForwardBackwardRequest, OptimStepRequest

BATCHES = microbatches(TEXTS)


def op(key: str, position: int | None = None, digest: bool = False) -> OperationSpec:
    return OperationSpec(key, position, digest)


def run_ops(host: SessionHost, start: int, pairs: int) -> list[object]:
    """``pairs`` × (forward_backward, optim_step) from position ``start``; keys ``k{position}``."""
    outcomes = []
    for position in range(start, start + 2 * pairs, 2):
        batch = BATCHES[(position // 2) % len(BATCHES)]
        outcomes.append(
            host.apply(
                ops.FORWARD_BACKWARD, ForwardBackwardRequest(batch), op(f"k{position}", position)
            )
        )
        outcomes.append(
            host.apply(ops.OPTIM_STEP, OptimStepRequest(), op(f"k{position + 1}", position + 1))
        )
    return outcomes
