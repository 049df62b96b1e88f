"""The one path every keyed (state-changing) operation takes through the active run.

The session host decides *whether* a run may take operations (lifecycle) and runs them on its
engine thread; ``apply_keyed`` decides what a keyed operation does, in this order:

1. the journal: the key seen with the same payload digest → the journaled result, nothing runs;
   the same key with another payload → ALREADY_EXISTS;
2. ``expected_position`` differs from the position → FAILED_PRECONDITION (``PositionMismatch``);
3. the operation's ``apply`` (``operations``) calls the engine (an engine error changes nothing
   and is not journaled);
4. the journal commits it durably with its position; only then does the caller hear of it.

As phases: ``begin`` (1 and 2, changing nothing), the engine call, ``end`` (4). A call alone
takes them through ``apply_keyed``; a call that shares one engine pass with other runs' calls
(the scheduler's shared passes) takes ``begin`` before the pass and ``end`` after it, so both
paths apply a key once, at its run's position, with the same outcome.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trainwire.contract.outcomes import OperationOutcome, OperationSpec
from trainwire.server.errors import AlreadyExists, PositionMismatch
from trainwire.server.service.active_run import ActiveRun, Applying, Durable
from trainwire.server.service.journal import JournalEntry, KeyDigest, outcome_from_record
from trainwire.server.service.operations import Operation


@dataclass(frozen=True)
class Begun:
    """A keyed call past its journal lookup and position check: either ``replayed`` (its key
    was applied already: its outcome, the engine is not called) or ``applying`` (new, at the
    run's position)."""

    replayed: OperationOutcome | None = None
    applying: Applying | None = None


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
    begun = begin(run, operation, op, digest)
    fields = None
    if begun.applying is not None:
        fields = operation.apply(run, request, begun.applying)  # an engine error: nothing kept
    return end(run, operation, request, op, begun, fields)


def begin(run: ActiveRun, operation: Operation[Any], op: OperationSpec, digest: KeyDigest) -> Begun:
    """The journal lookup and the position check: what the call is before the engine is
    called. Changes nothing (a call looked at and then left to its own turn begins again).

    Raises ``AlreadyExists`` (the key bound to another payload) or ``PositionMismatch``."""
    entry = run.journal.lookup(op.key)
    if entry is not None:
        return Begun(replayed=_replay(run, entry, operation, digest, op))
    if op.expected_position is not None and op.expected_position != run.position:
        raise PositionMismatch(
            f"expected_position {op.expected_position}, but the session is at position "
            f"{run.position} (last operation {run.last_key!r}); resume from "
            f"position {run.position}",
            run.position,
        )
    return Begun(
        applying=Applying(
            operation.kind, operation.outcome_type, op.key, run.position + 1, digest.value
        )
    )


def end(
    run: ActiveRun,
    operation: Operation[Any],
    request: Any,
    op: OperationSpec,
    begun: Begun,
    fields: dict[str, Any] | None,
) -> tuple[Any, Durable]:
    """After the engine call gave ``fields`` (None for a replay): the outcome, committed to
    the journal with its position (the run moves to it), and the commit to wait on."""
    if begun.applying is None:
        assert begun.replayed is not None
        outcome, durable = begun.replayed, run.journal.durable(op.key)
    else:
        assert fields is not None
        outcome, durable = _commit(run, begun.applying, op, fields)
    if operation.complete is not None:
        outcome = operation.complete(run, request, outcome)
    return outcome, durable


def _commit(
    run: ActiveRun, applying: Applying, op: OperationSpec, fields: dict[str, Any]
) -> tuple[OperationOutcome, Durable]:
    outcome = applying.outcome(fields)
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
