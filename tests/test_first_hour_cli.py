"""The first hour's command-line stings, each as the README's reader met it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from service_fixtures import connect, running_server

from trainwire.cli import main
from trainwire.client import ManagedTrainingPlan, TrainingConfig
from trainwire.contract.planning.manifest import write_plan_manifest
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import make_tiny_model, tiny_text_examples

REPO = Path(__file__).resolve().parents[1]
RL_LOOP = REPO / "examples" / "rl_loop.py"


def test_a_config_without_max_length_opens_on_the_projects_own_tiny_models(tiny_llama):
    session = TrainingSession(TrainingConfig(model=str(tiny_llama)), device="cpu")
    assert session.encoder.max_length == TrainingConfig(model="m").max_length


def test_train_without_model_root_names_the_option(tmp_path, monkeypatch, capsys):
    manifest = tmp_path / "manifest.json"
    plan = ManagedTrainingPlan(tiny_text_examples(4), TrainingConfig(model="llama"))
    write_plan_manifest(manifest, plan)
    monkeypatch.chdir(tmp_path)  # no llama/ here: it lives under a model root
    code = main(["train", "--manifest", str(manifest), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "model 'llama'" in err and "give --model-root DIR" in err


def test_demo_against_a_server_whose_model_root_misses_the_work_dir_says_where_to_put_it(
    model_root, tmp_path, capsys
):
    with running_server(tmp_path / "state", model_root) as handle:
        work = tmp_path / "outside-the-model-root"
        code = main(["demo", "--fast", "--server", handle.target, "--work-dir", str(work)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"the demo wrote its model to {work.resolve() / 'models'}" in err
    assert "give --work-dir a directory under that root" in err


def run_loop(target: str, *options: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(RL_LOOP), "--server", target, "--model", "llama", *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_rl_example_runs_again_and_never_continues_a_run_left_open(tmp_path):
    models = tmp_path / "models"
    make_tiny_model(models / "llama")
    with running_server(tmp_path / "state", models) as handle:
        for _ in range(2):  # each run opens a new run and closes it: the next one starts
            done = run_loop(handle.target, "--rounds", "1")
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("step 0: reward ")
        with connect(handle) as client:
            assert client.info().state == "closed"
            config = TrainingConfig("llama", learning_rate=3e-2, lr_scheduler="constant")
            client.open("left-open", config)  # another loop's run, still open
        refused = run_loop(handle.target, "--rounds", "1", "--run-id", "left-open")
    assert refused.returncode != 0 and "step 0" not in refused.stdout
    assert "run left-open is already open on the server" in refused.stderr
    assert f"trainwire close --server {handle.target} --run-id left-open" in refused.stderr


def test_make_help_lists_the_targets_and_make_bench_runs_something():
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.skip("needs make")
    helped = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True)
    assert helped.returncode == 0
    for target in ("demo", "test", "test-all", "bench", "lint", "protos"):
        assert f"make {target} " in helped.stdout
    bench = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "bench"], cwd=REPO, capture_output=True, text=True
    )
    assert "bench/" in bench.stdout


def test_serve_on_an_address_in_use_says_so_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        command = [sys.executable, "-m", "trainwire", "serve", "--listen", listen]
        done = subprocess.run(
            [*command, "--state-dir", str(tmp_path / "state"), "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    errors = [line for line in done.stderr.splitlines() if "Warning" not in line and line.strip()]
    assert done.returncode == 2
    assert errors == [
        f"trainwire serve: error: --listen {listen}: the address is in use (another trainwire "
        "serve, or another program, listens there); stop it or choose another port"
    ]
