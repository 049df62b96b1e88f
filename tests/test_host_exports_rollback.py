"""Exports belong to their journal entry: a restart that forgets an ExportWeights forgets its
files too, and replaying the forgotten operations writes the same export again."""

from __future__ import annotations

import pytest
from host_operations import BATCHES, op

from trainwire.contract import outcomes
from trainwire.server.errors import NotFound
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    ForwardBackwardRequest,
    LoadWeightsRequest,
)


def test_an_export_of_a_forgotten_timeline_is_removed_and_replayed_identically(host, make_host):
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb-1", 0))
    host.apply(ops.SAVE_STATE, CheckpointRequest("c"), op("save", 1))
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb-2", 2))
    exported = host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("e"), op("export", 3))
    export_dir = exported.directory
    first_files = exported.files
    host.release()  # a crash: fb-2 and the export are after the checkpoint

    restarted = make_host()
    assert restarted.info().position == 2
    assert not export_dir.exists()
    with pytest.raises(NotFound):
        restarted.apply(
            ops.LOAD_WEIGHTS,
            LoadWeightsRequest(outcomes.WeightsSource("export", "e")),
            op("load-e", 2),
        )
    restarted.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[1]), op("fb-2", 2))
    again = restarted.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("e"), op("export", 3))
    assert not again.replayed and again.files == first_files
