"""Every path a command takes may be relative to where the user stands, as the README writes them
(``trainwire inspect state``, ``trainwire plan --examples examples/train.jsonl ...``)."""

from __future__ import annotations

import json

from host_operations import BATCHES, op

from trainwire.cli import main
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    ForwardBackwardRequest,
)
from trainwire.testing import tiny_text_examples


def test_plan_and_inspect_take_relative_paths(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with open("data/train.jsonl", "w", encoding="utf-8") as lines:
        for example in tiny_text_examples(6):
            lines.write(json.dumps({"text": example.text}) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model": "llama", "batch_size": 2}))

    plan = ["plan", "--examples", "data/train.jsonl", "--config", "config.json"]
    assert main([*plan, "--output", "manifest.json"]) == 0
    assert main(["inspect", "manifest.json"]) == 0
    assert "microbatches" in capsys.readouterr().out


def test_inspect_takes_a_relative_state_dir_checkpoint_and_export(
    make_host, host_config, monkeypatch, capsys
):
    host = make_host()
    host.open("run", host_config, 10, "sha256:plan")
    host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCHES[0]), op("fb", 0))
    host.apply(ops.SAVE_STATE, CheckpointRequest("early"), op("save", 1))
    host.apply(ops.EXPORT_WEIGHTS, ExportWeightsRequest("final"), op("export", 2))
    state_dir = host.state_dir.root
    monkeypatch.chdir(state_dir.parent)

    assert main(["inspect", state_dir.name]) == 0
    assert "position     3 (last export)" in capsys.readouterr().out
    for kind in ("checkpoints/early", "exports/final"):
        found = sorted(state_dir.rglob(kind))
        assert found, kind
        relative = found[0].relative_to(state_dir.parent)
        assert main(["inspect", str(relative)]) == 0, relative
        assert capsys.readouterr().out.strip()


def test_output_piped_into_head_ends_quietly(tmp_path, monkeypatch):
    """``trainwire inspect manifest.json | head -1``: the reader leaving is no error of ours (it
    printed "error: [Errno 32] Broken pipe")."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n' * 4)
    (tmp_path / "config.json").write_text(json.dumps({"model": "llama", "batch_size": 1}))
    args = ["--examples", "train.jsonl", "--config", "config.json", "--output", "m.json"]
    assert main(["plan", *args]) == 0
    # ``true`` leaves before trainwire writes (it reads nothing), as ``head`` does once it has
    # its lines: the write always meets a closed pipe.
    done = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m trainwire inspect m.json | true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
