"""A request the intake accepted is hashed once: the journal binds its key to the digest the intake
took of its body, and compares that one digest only: a key bound to a gRPC request's payload
digest refuses an accepted request under it, whatever its body."""

from __future__ import annotations

import pytest
from host_operations import BATCHES, op
from ledger_files import opened_journal

from trainwire.server.errors import AlreadyExists
from trainwire.server.service import operations as ops
from trainwire.server.service.journal import payload_digest, request_digest
from trainwire.server.service.requests import ForwardBackwardRequest, OptimStepRequest

BODY_DIGEST = "ab" * 32  # what the intake's digest of a request body looks like


def test_the_journal_binds_an_accepted_request_to_its_body_digest(host):
    batch = ForwardBackwardRequest(BATCHES[0])
    first = host.apply_checked(ops.FORWARD_BACKWARD, batch, op("m/1"), body_digest=BODY_DIGEST)
    again = host.apply_checked(ops.FORWARD_BACKWARD, batch, op("m/1"), body_digest=BODY_DIGEST)
    assert again.replayed and again.loss == first.loss and host.info().position == 1
    with pytest.raises(AlreadyExists, match="another ForwardBackward payload"):
        host.apply_checked(ops.FORWARD_BACKWARD, batch, op("m/1"), body_digest="cd" * 32)
    host.release()
    with opened_journal(host.state_dir.root, "run") as journal:
        entry = journal.lookup("m/1")
    assert entry is not None and entry.payload_sha256 == request_digest(BODY_DIGEST)
    assert entry.payload_sha256 != payload_digest(
        "forward_backward", ops.FORWARD_BACKWARD.payload(batch)
    )


def test_a_key_bound_to_a_payload_digest_refuses_an_accepted_request_under_it(host):
    batch = ForwardBackwardRequest(BATCHES[0])
    host.apply(ops.FORWARD_BACKWARD, batch, op("m/1"))  # bound to the payload's digest
    with pytest.raises(AlreadyExists, match="another ForwardBackward payload"):
        host.apply_checked(ops.FORWARD_BACKWARD, batch, op("m/1"), body_digest=BODY_DIGEST)
    assert host.info().position == 1
    other = ForwardBackwardRequest(BATCHES[1])
    with pytest.raises(AlreadyExists, match="another ForwardBackward payload"):
        host.apply_checked(ops.FORWARD_BACKWARD, other, op("m/1"), body_digest=BODY_DIGEST)
    with pytest.raises(AlreadyExists, match="another ForwardBackward payload"):
        host.apply_checked(ops.OPTIM_STEP, OptimStepRequest(), op("m/1"), body_digest=BODY_DIGEST)
