"""Which weights a sample of a snapshot reads, decided by the service at the sample's turn
(``SampleRequest.live_at``): the live weights while the run's weights are still the ones the
export was written at, the export once an update or a load moved them on, and ``export_gone``'s
refusal when the export can no longer be read. Nothing a transport does after an update has to
run before the next sample: the engine counts its weight changes itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from host_operations import op, run_ops

from trainwire.contract.outcomes import WeightsSource
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    LoadWeightsRequest,
    SampleRequest,
)

PROMPT = [5, 9, 14]


def _sample(host, **weights) -> list:
    request = SampleRequest(PROMPT, max_tokens=6, num_samples=2, seed=3, **weights)
    return [(s.tokens, s.logprobs) for s in host.apply(ops.SAMPLE, request).samples]


def _snapshot(host, name: str) -> tuple[int, Path]:
    """An export of the live weights: the run's weights version it holds, and its directory."""
    saved = host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest(name), op(f"export-{name}"))
    return host.weights_version(""), saved.directory


def test_a_snapshot_reads_the_live_weights_until_an_update_moves_them(host):
    run_ops(host, 0, 1)
    version, directory = _snapshot(host, "snap")
    live = _sample(host)
    assert _sample(host, export="snap") == live  # the same weights, swapped in

    moved = directory.with_name("snap-away")
    shutil.move(directory, moved)  # the export cannot be what this sample reads
    gone = "the snapshot was pruned"
    assert _sample(host, export="snap", live_at=version, export_gone=gone) == live

    run_ops(host, 3, 1)  # an update: the live weights are no longer the snapshot's
    assert host.weights_version("") == version + 1
    assert _sample(host) != live
    with pytest.raises(FailedPrecondition, match=gone):
        _sample(host, export="snap", live_at=version, export_gone=gone)
    shutil.move(moved, directory)
    assert _sample(host, export="snap", live_at=version) == live  # the export, swapped in


def test_a_load_moves_the_live_weights_on_too(host):
    run_ops(host, 0, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save"))
    version, _ = _snapshot(host, "snap")
    load = LoadWeightsRequest(WeightsSource("checkpoint", "c1"))
    host.apply(ops.LOAD_WEIGHTS, load, op("load"))  # the same values, but a load
    assert host.weights_version("") == version + 1
    with pytest.raises(FailedPrecondition, match="gone"):
        _sample(host, export="snap", live_at=version, export_gone="gone")


def test_live_at_and_export_gone_are_about_an_export(host):
    for weights in ({"live_at": 0}, {"export_gone": "why"}):
        with pytest.raises(InvalidArgument, match="about an export"):
            _sample(host, **weights)
