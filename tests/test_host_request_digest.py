"""A request the intake accepted is hashed once: the journal binds its key to the digest the intake
took of its body. A key that an earlier version journaled with its payload's digest still answers
the same request (and still refuses another payload under it)."""

from __future__ import annotations

import pytest
from host_operations import BATCHES, op

from trainwire.server.errors import AlreadyExists
from trainwire.server.service import operations as ops
from trainwire.server.service.journal import Journal, payload_digest, request_digest
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
    journal = Journal(host.state_dir.run("run").journal_path)
    entry = journal.lookup("m/1")
    journal.close()
    assert entry is not None and entry.payload_sha256 == request_digest(BODY_DIGEST)
    assert entry.payload_sha256 != payload_digest(
        "forward_backward", ops.FORWARD_BACKWARD.payload(batch)
    )


def test_a_key_an_earlier_version_bound_to_its_payload_digest_still_answers_its_request(host):
    batch = ForwardBackwardRequest(BATCHES[0])
    first = host.apply(ops.FORWARD_BACKWARD, batch, op("m/1"))  # the payload's digest, as before
    again = host.apply_checked(ops.FORWARD_BACKWARD, batch, op("m/1"), body_digest=BODY_DIGEST)
    assert again.replayed and again.loss == first.loss and host.info().position == 1
    other = ForwardBackwardRequest(BATCHES[1])
    with pytest.raises(AlreadyExists, match="another ForwardBackward payload"):
        host.apply_checked(ops.FORWARD_BACKWARD, other, op("m/1"), body_digest=BODY_DIGEST)
    with pytest.raises(AlreadyExists, match="another ForwardBackward payload"):
        host.apply_checked(ops.OPTIM_STEP, OptimStepRequest(), op("m/1"), body_digest=BODY_DIGEST)
