"""Which ready jobs of several runs share one pass over their base, and running that pass.

The scheduler takes the job whose turn it is; when it has a ``Shared`` part (a LoRA run's
``forward_backward`` or ``forward``), the jobs at the heads of the other lanes are offered to
it here, one per lane, in the order of their turns. A job joins when it is of the same base and
kind, its own ``begin`` gives an engine request (it changes nothing: a job left out begins again
at its own turn), ``engine.together.group_together`` puts it in the first job's group under the
base's ``row_invariance`` (the device's kernels give a row the same bits alone and stacked; else
nothing joins), and the group's examples stay within what one request may hold
(``request_limits``: a group is split there, never grown past it). The pass then gives each job
the result it gets alone, bit for bit; its ``end`` commits it.

A pass that fails having changed nothing (a request refused by its session, shapes the pass
refuses, out of memory before the backward: ``run_together`` raises those before any session
changes) runs each job alone instead, where each meets its own error or result. Any other
failure reaches every job of the pass through its ``end`` (a backward that failed midway left
their sessions broken).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent import futures

from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.together import (
    Request,
    RowInvariance,
    group_together,
    row_invariance,
    run_together,
)
from trainwire.server.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
)
from trainwire.server.service.request_limits import MAX_EXAMPLES, check_batch
from trainwire.server.service.scheduler_jobs import Job

logger = logging.getLogger(__name__)

# What ``run_together`` raises before any session changed: the jobs then run alone.
CHANGED_NOTHING = (FailedPrecondition, InvalidArgument, ResourceExhausted)


def may_join(first: Job, other: Job) -> bool:
    """Whether ``other`` may be offered to ``first``'s pass: same base, same kind."""
    mine, theirs = first.shared, other.shared
    return (
        mine is not None
        and theirs is not None
        and theirs.base is mine.base
        and theirs.backward == mine.backward
    )


def begin(job: Job) -> Request | None:
    """``job``'s engine request for a pass; None when it runs alone (its key is replayed, or
    its solo call would refuse it: it meets that at its turn)."""
    assert job.shared is not None
    try:
        return job.shared.begin()
    except Exception:
        return None


def group(
    begun: Sequence[tuple[Job, Request]],
) -> tuple[list[tuple[Job, Request]], RowInvariance | None]:
    """The first job and those of the others that may share its pass, in their order, and the
    invariance they share it under. What fails while grouping leaves the first job alone (the
    engine thread goes on; each job meets its own error at its turn)."""
    requests = [request for _, request in begun]
    try:
        invariance = row_invariance(requests[0].session.model)  # probed once per device, shapes
        if invariance.min_rows is None:
            return [begun[0]], invariance
        indices = group_together(requests, invariance)[0]
    except Exception:
        logger.exception("runs could not be grouped for a shared pass: they run alone")
        return [begun[0]], None
    joined: list[tuple[Job, Request]] = []
    for index in indices:
        if within_one_request([request for _, request in joined] + [requests[index]]):
            joined.append(begun[index])
    return joined, invariance


def within_one_request(requests: Sequence[Request]) -> bool:
    """Whether the requests' examples together stay within the bounds of one request."""
    examples = [example for request in requests for example in request.examples]
    if len(examples) > MAX_EXAMPLES:
        return False
    tokens = [example for example in examples if isinstance(example, TokenExample)]
    texts = [example for example in examples if not isinstance(example, TokenExample)]
    try:
        check_batch(tokens)
        check_batch(texts)
    except ResourceExhausted:
        return False
    return True


def run_pass(
    joined: Sequence[tuple[Job, Request]], invariance: RowInvariance, *, backward: bool
) -> bool:
    """Run the pass and give each job its ``outcome`` (through its ``end``); False when the
    pass changed nothing and failed: the caller runs each job alone."""
    try:
        results = run_together([request for _, request in joined], invariance, backward=backward)
    except CHANGED_NOTHING as error:
        logger.info("a shared pass of %d runs was refused (%s): they run alone", len(joined), error)
        return False
    except Exception as error:
        for job, _ in joined:
            _end(job, error)
        return True
    for (job, _), result in zip(joined, results, strict=True):
        _end(job, result)
    return True


def _end(job: Job, result: object) -> None:
    assert job.shared is not None
    job.outcome = futures.Future()
    try:
        job.outcome.set_result(job.shared.end(result))  # type: ignore[arg-type]
    except BaseException as error:
        job.outcome.set_exception(error)
