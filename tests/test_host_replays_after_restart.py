"""Operations journaled after the restored checkpoint run again after a restart, as the first
time: a replayed LoadState included (recovery itself restored the session through load_state)."""

from __future__ import annotations

from host_operations import BATCHES, op

from trainwire.server.service import operations as ops
from trainwire.server.service.requests import CheckpointRequest, ForwardBackwardRequest


def test_a_journaled_load_state_replays_after_a_restart(host, make_host):
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb", 0))
    host.apply(ops.SAVE_STATE, CheckpointRequest("a"), op("save", 1))
    host.release()
    # A new server on the same state: it restores "a", then the run loads "a" on purpose.
    second = make_host()
    loaded = second.apply(ops.LOAD_STATE, CheckpointRequest("a"), op("load", 2))
    after_load = second.apply(
        ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb-2", 3)
    )
    final = second.info()
    second.release()  # a crash: the load and the microbatch after it are rolled back

    third = make_host()
    assert third.info().position == 2  # at "a" again
    replayed = third.apply(ops.LOAD_STATE, CheckpointRequest("a"), op("load", 2))
    assert not replayed.replayed and replayed.position == loaded.position == 3
    again = third.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb-2", 3))
    assert (again.loss, again.position) == (after_load.loss, after_load.position)
    assert third.info().state_digest == final.state_digest
