"""What a session host reads and writes stays inside its directories: odd checkpoint and export
names are refused before anything runs, symlinks cannot lead out of the state directory, and model
paths resolve under the model root.
"""

from __future__ import annotations

import os

import pytest
from host_operations import op

from trainwire.contract.outcomes import WeightsSource
from trainwire.server.errors import (
    InvalidArgument,
)
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    LoadWeightsRequest,
)


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ".hidden", "", "x" * 129, "a b"])
def test_odd_names_are_refused_before_anything_runs(host, name):
    calls = [
        lambda: host.apply(ops.SAVE_STATE, CheckpointRequest(name), op("k")),
        lambda: host.apply(ops.LOAD_STATE, CheckpointRequest(name), op("k")),
        lambda: host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest(name), op("k")),
        lambda: host.apply(
            ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("checkpoint", name)), op("k")
        ),
        lambda: host.apply(
            ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("export", name)), op("k")
        ),
    ]
    if name:  # an empty checkpoint means "the live state"
        calls.append(
            lambda: host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("ok", name), op("k"))
        )
    for call in calls:
        with pytest.raises(InvalidArgument, match="is not allowed: use 1-128 characters"):
            call()
    assert host.info().position == 0


def test_symlinks_cannot_lead_out_of_the_state_directory(host, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, host.state_dir.run("run").checkpoints / "evil")

    with pytest.raises(InvalidArgument, match="resolves outside"):
        host.apply(ops.SAVE_STATE, CheckpointRequest("evil"), op("k"))
    assert list(outside.iterdir()) == []


def test_model_paths_resolve_under_the_model_root(host, tiny_llama):
    with pytest.raises(InvalidArgument, match="outside the model root"):
        host.apply(
            ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("model_path", "../../etc")), op("k1")
        )
    with pytest.raises(InvalidArgument, match="outside the model root"):
        host.apply(
            ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("model_path", "/etc")), op("k1")
        )

    loaded = host.apply(
        ops.LOAD_WEIGHTS,
        LoadWeightsRequest(WeightsSource("model_path", tiny_llama.name)),
        op("k1", 0),
    )

    assert loaded.position == 1
