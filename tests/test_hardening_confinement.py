"""Issue 15, item 10: a symlink planted in the state directory or a model directory leads
nowhere. Every path is confined against the real state root or model root: a linked folder of
the state directory is a tampered state directory (FAILED_PRECONDITION), a file linked out of a
checkpoint, export or model is refused, and nothing is written outside.
"""

from __future__ import annotations

import os
import shutil

import pytest
from host_operations import op, run_ops

from trainwire.contract.outcomes import WeightsSource
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    LoadWeightsRequest,
)
from trainwire.server.service.state_dir import list_export_files


def _link_outside(folder, outside) -> None:
    """Replace ``folder`` by a link to ``outside`` (holding a copy of what it held)."""
    shutil.copytree(folder, outside, dirs_exist_ok=True)
    shutil.rmtree(folder)
    os.symlink(outside, folder, target_is_directory=True)


def _files(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("linked", ["checkpoints", "exports", "run"])
def test_a_linked_folder_of_the_state_directory_is_refused_and_nothing_lands_outside(
    host, tmp_path, linked
):
    run_ops(host, 0, 1)
    run = host.state_dir.run("run")
    outside = tmp_path / "outside"
    folder = {"checkpoints": run.checkpoints, "exports": run.exports, "run": run.path}[linked]
    _link_outside(folder, outside)
    before = _files(outside)

    calls = {
        "checkpoints": [lambda: host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save", 2))],
        "exports": [
            lambda: host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("e1"), op("export", 2))
        ],
    }
    for call in calls.get(linked, calls["checkpoints"] + calls["exports"]):
        with pytest.raises(FailedPrecondition, match="is a symbolic link") as refused:
            call()
        assert str(tmp_path) not in str(refused.value), "a server path reached the message"
    assert _files(outside) == before
    assert host.info().position == 2


@pytest.mark.parametrize("source", ["load_state", "checkpoint", "export_from"])
def test_a_file_linked_out_of_a_checkpoint_is_refused(host, tmp_path, source):
    run_ops(host, 0, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("c1"), op("save", 2))
    checkpoint = host.state_dir.run("run").checkpoint("c1")
    outside = tmp_path / "outside.safetensors"
    shutil.move(checkpoint / "model.safetensors", outside)
    os.symlink(outside, checkpoint / "model.safetensors")
    calls = {
        "load_state": lambda: host.apply(ops.LOAD_STATE, CheckpointRequest("c1"), op("load", 3)),
        "checkpoint": lambda: host.apply(
            ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("checkpoint", "c1")), op("lw", 3)
        ),
        "export_from": lambda: host.apply(
            ops.EXPORT_WEIGHTS, ExportWeightsRequest("e", "c1"), op("e", 3)
        ),
    }
    with pytest.raises(FailedPrecondition, match=r"holds a symbolic link.*model\.safetensors"):
        calls[source]()
    assert host.info().position == 3


def test_an_export_file_linked_outside_is_never_listed_or_sent(host, tmp_path):
    host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("e1"), op("export", 0))
    export = host.state_dir.run("run").export("e1")
    secret = tmp_path / "secret.txt"
    secret.write_text("server secret")
    os.symlink(secret, export / "extra.txt")
    with pytest.raises(FailedPrecondition, match="holds a symbolic link"):
        list_export_files(export)
    with pytest.raises(FailedPrecondition, match="holds a symbolic link"):
        host.state_dir.run("run").export("e1")


def _model_copy(tiny_llama, model_root, name):
    copy = model_root / name
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(tiny_llama, copy)
    return copy


def test_a_model_file_linked_outside_the_model_root_is_refused(
    host, tiny_llama, model_root, tmp_path, llama_config
):
    model = _model_copy(tiny_llama, model_root, "linked-out")
    outside = tmp_path / "weights.safetensors"
    shutil.move(model / "model.safetensors", outside)
    os.symlink(outside, model / "model.safetensors")

    with pytest.raises(InvalidArgument, match="links outside the model root") as refused:
        host.apply(
            ops.LOAD_WEIGHTS,
            LoadWeightsRequest(WeightsSource("model_path", "linked-out")),
            op("lw", 0),
        )
    assert str(tmp_path) not in str(refused.value)
    assert str(model_root) not in str(refused.value)
    from trainwire.server.engine.session import TrainingSession

    with pytest.raises(InvalidArgument, match="links outside the model root"):
        TrainingSession(llama_config(model="linked-out"), model_root=model_root)
    assert host.info().position == 0


def test_links_that_stay_inside_the_model_root_load(host, tiny_llama, model_root):
    """A Hugging Face cache links snapshot files to blobs beside them: inside the root, fine."""
    model = _model_copy(tiny_llama, model_root, "cache-like")
    blobs = model_root / "blobs"
    blobs.mkdir(exist_ok=True)
    shutil.move(model / "model.safetensors", blobs / "weights")
    os.symlink(os.path.relpath(blobs / "weights", model), model / "model.safetensors")

    loaded = host.apply(
        ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("model_path", "cache-like")), op("lw", 0)
    )
    assert loaded.position == 1


@pytest.mark.parametrize("name", ["[" * 5000, "a\x00b", "x/" * 3000])
def test_an_unusable_model_path_is_invalid_argument_without_server_paths(host, model_root, name):
    """Found by the fuzzer: a 5,000-character path was INTERNAL and named the model root."""
    with pytest.raises(
        InvalidArgument, match=r"not a usable path|outside the model root"
    ) as refused:
        host.apply(
            ops.LOAD_WEIGHTS, LoadWeightsRequest(WeightsSource("model_path", name)), op("lw", 0)
        )
    assert str(model_root) not in str(refused.value)
