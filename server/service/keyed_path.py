"""The one path every keyed (state-changing) operation takes through the active run.

The session host decides *whether* a run may take operations (lifecycle) and runs them on its
engine thread; ``apply_keyed`` decides what a keyed operation does, in this order:

1. the journal: the key seen with the same payload digest → the journaled result, nothing runs;
   the same key with another payload → ALREADY_EXISTS;
2. ``expected_position`` differs from the position → FAILED_PRECONDITION (``PositionMismatch``);
3. the operation's ``apply`` (``operations``) calls the engine (an engine error changes nothing
   and is not journaled);
4. the journal commits it durably with its position; only then does the caller hear of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainwire.contract.outcomes import OperationOutcome, OperationSpec
from trainwire.server.errors import AlreadyExists, PositionMismatch
from trainwire.server.service.active_run import ActiveRun, Applying, Durable
from trainwire.server.service.journal import JournalEntry, KeyDigest, outcome_from_record
from trainwire.server.service.operations import Operation


def apply_keyed(
    run: ActiveRun,
    operation: Operation[Any],
    request: Any,
    op: OperationSpec,
    digest: KeyDigest,
) -> tuple[Any, Durable]:
    """Journal lookup, position check, ``operation.apply``, commit: in that order.

    Returns the outcome and the commit it waits on (None when already on disk). The caller must
    wait for it before anyone hears of the outcome; a gRPC caller waits on its own thread, so the
    next operation runs while this one's fsync completes (group commit). A commit that fails raises
    ``JournalCommitFailed`` there (only a restart makes journal and engine agree).
    """
    entry = run.journal.lookup(op.key)
    if entry is not None:
        outcome = _replay(run, entry, operation, digest, op)
        durable = run.journal.durable(op.key)
    else:
        outcome, durable = _apply_new(run, operation, request, op, digest.value)
    if operation.complete is not None:
        outcome = operation.complete(run, request, outcome)
    return outcome, durable


def _apply_new(
    run: ActiveRun,
    operation: Operation[Any],
    request: Any,
    op: OperationSpec,
    payload_digest: str,
) -> tuple[OperationOutcome, Durable]:
    if op.expected_position is not None and op.expected_position != run.position:
        raise PositionMismatch(
            f"expected_position {op.expected_position}, but the session is at position "
            f"{run.position} (last operation {run.last_key!r}); resume from "
            f"position {run.position}",
            run.position,
        )
    applying = Applying(
        operation.kind, operation.outcome_type, op.key, run.position + 1, payload_digest
    )
    outcome = applying.outcome(operation.apply(run, request, applying))
    if op.include_digest and not outcome.state_digest:
        outcome = dataclasses.replace(outcome, state_digest=run.session.state_digest())
    durable = run.journal.commit_async(applying.entry(outcome))
    run.position, run.last_key = applying.position, applying.key
    return outcome, durable


def _replay(
    run: ActiveRun,
    entry: JournalEntry,
    operation: Operation[Any],
    digest: KeyDigest,
    op: OperationSpec,
) -> OperationOutcome:
    if entry.kind != operation.kind or not digest.matches(entry.payload_sha256):
        raise AlreadyExists(
            f"operation key {op.key!r} was already used for another {entry.kind} payload "
            f"(applied as operation {entry.position}); send a new key for a new operation"
        )
    outcome = outcome_from_record(operation.outcome_type, entry.result, replayed=True)
    if op.include_digest and not outcome.state_digest and entry.position == run.position:
        outcome = dataclasses.replace(outcome, state_digest=run.session.state_digest())
    return outcome
