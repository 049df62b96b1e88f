"""Ctrl-C on ``trainwire run`` says how to go on, and the command it names resumes the run."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys

import pytest
from service_fixtures import running_server

from trainwire.client import ManagedTrainingPlan, TrainingConfig, write_manifest
from trainwire.testing import tiny_text_examples


@pytest.mark.slow
def test_ctrl_c_on_run_names_the_command_that_resumes_it_and_that_command_finishes(
    tiny_llama, model_root, tmp_path
):
    config = TrainingConfig(model=tiny_llama.name, batch_size=1, learning_rate=1e-3)
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, ManagedTrainingPlan(tiny_text_examples(60), config).to_manifest())
    with running_server(tmp_path / "state", model_root) as handle:
        args = ["run", "--server", handle.target, "--manifest", str(manifest), "--run-id", "cc",
                "--work-dir", str(tmp_path / "work"), "--log-every", "1"]  # fmt: skip
        command = [sys.executable, "-m", "trainwire", *args]
        first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert first.stderr is not None
        for line in first.stderr:  # no tty: a progress line per update, on standard error
            if "step 3/60" in line:
                break
        first.send_signal(signal.SIGINT)
        _, rest = first.communicate(timeout=120)
        err = line + rest
        assert first.returncode == 130, err
        hint = err.strip().splitlines()[-1]
        assert "interrupted; run the same command again to resume where it stopped" in hint, err
        printed = shlex.split(hint.split("stopped: ", 1)[1])
        assert printed == ["trainwire", *args]

        again = subprocess.run(
            [sys.executable, "-m", "trainwire", *printed[1:]],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert again.returncode == 0, again.stderr
    assert "run cc done" in again.stdout
    summary = json.loads((tmp_path / "work" / "training_summary.json").read_text())
    assert summary["state_digest"] in again.stdout
