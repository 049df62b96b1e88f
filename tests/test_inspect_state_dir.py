"""``trainwire inspect STATE_DIR`` lists the server's runs: open and closed, their model, position,
checkpoints and exports, read while a server holds the directory (nothing is written)."""

from __future__ import annotations

from host_operations import BATCHES, op

from trainwire.cli import main
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    ForwardBackwardRequest,
    OptimStepRequest,
)


def test_inspect_lists_every_run_of_a_state_directory_in_use(make_host, host_config, capsys):
    host = make_host()
    host.open("first", host_config, 10, "sha256:plan")
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb", 0))
    host.apply(ops.SAVE_STATE, CheckpointRequest("early"), op("save", 1))
    host.close("first")
    host.open("second", host_config, 10, "sha256:plan")
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb", 0))
    host.apply(ops.OPTIM_STEP, OptimStepRequest(), op("step", 1))
    host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("final"), op("export", 2))
    state_dir = host.state_dir.root
    before = sorted(p.relative_to(state_dir) for p in state_dir.rglob("*"))

    assert main(["inspect", str(state_dir)]) == 0
    out = capsys.readouterr().out
    assert "runs         2" in out
    first, second = out.split("\nrun ")[1:]
    assert first.startswith("         first (closed)")
    assert "position     2 (last save)" in first and "checkpoints  early" in first
    assert second.startswith("         second (open)")
    assert "position     3 (last export)" in second and "exports      final" in second
    assert "LoRA" in second or "full weights" in second
    assert sorted(p.relative_to(state_dir) for p in state_dir.rglob("*")) == before
