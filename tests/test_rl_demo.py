"""`trainwire demo --rl` and examples/rl_loop.py: the RL loop through a real local server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest
import yaml

from trainwire.cli import main
from trainwire.rl_demo import RlDemoSettings, RlResult, run_rl_demo
from trainwire.server import serve
from trainwire.testing import make_tiny_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_loop.py"
SHORT = RlDemoSettings(rounds=3)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> RlResult:
    return run_rl_demo(tmp_path_factory.mktemp("rl-short"), settings=SHORT, quiet=True)


def assert_the_reward_rose_and_the_files_hold_it(result: RlResult, settings: RlDemoSettings):
    summary = json.loads(result.files["json"].read_text())
    rewards = summary["rewards"]
    assert rewards == result.rewards
    assert len(rewards) == settings.rounds == len(summary["rounds"])
    # A fresh model says the word about once in 500 tokens; training makes it say it often.
    assert mean(rewards[:3]) < 0.02 and mean(rewards[-3:]) > 0.2
    assert summary["state_digest"] == result.state_digest
    assert result.state_digest.startswith("sha256:")
    assert yaml.safe_load(result.files["yaml"].read_text()) == summary
    assert result.files["curve"].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_fast_rl_demo_raises_the_mean_reward_and_writes_its_summary_and_curve(tmp_path):
    result = run_rl_demo(tmp_path, settings=RlDemoSettings.fast(), quiet=True)
    assert_the_reward_rose_and_the_files_hold_it(result, RlDemoSettings.fast())
    assert result.files["json"].parent == tmp_path.resolve() / "rl"


@pytest.mark.slow
def test_the_default_rl_demo_raises_the_mean_reward_to_near_one(tmp_path):
    result = run_rl_demo(tmp_path, quiet=True)  # what `trainwire demo --rl` runs
    assert_the_reward_rose_and_the_files_hold_it(result, RlDemoSettings())
    assert mean(result.rewards[-3:]) > 0.9


def test_the_same_settings_give_the_same_rewards_and_the_same_final_digest(short_run, tmp_path):
    again = run_rl_demo(tmp_path, settings=SHORT, quiet=True)
    assert again.rewards == short_run.rewards
    assert again.state_digest == short_run.state_digest


def test_every_update_is_on_policy_up_to_the_last_bits_of_a_padded_batch(short_run):
    updates = [r for r in short_run.rounds if r["examples"]]
    assert updates
    for record in updates:
        assert record["ratio_max"] == pytest.approx(1.0, abs=1e-5)


def test_the_example_loop_runs_against_a_real_server_and_is_the_demos_run(short_run, tmp_path):
    make_tiny_model(tmp_path / "models" / "tiny-llama")
    models = tmp_path / "models"
    handle = serve(
        listen="127.0.0.1:0", state_dir=tmp_path / "state", model_root=models, device="cpu"
    )
    try:
        command = [sys.executable, str(EXAMPLE), "--server", f"127.0.0.1:{handle.port}"]
        command += ["--model", "tiny-llama", "--rounds", str(SHORT.rounds)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        handle.stop()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    rewards = [line.split()[3] for line in lines if line.startswith("step ")]
    assert rewards == [f"{r:.3f}" for r in short_run.rewards]
    assert lines[-1] == f"final state digest {short_run.state_digest}"


@pytest.mark.parametrize(
    ("flags", "settings"), [((), RlDemoSettings()), (("--fast",), RlDemoSettings.fast())]
)
def test_trainwire_demo_rl_runs_the_rl_demo_on_its_defaults(monkeypatch, tmp_path, flags, settings):
    calls = []
    monkeypatch.setattr("trainwire.rl_demo.run_rl_demo", lambda *a, **kw: calls.append((a, kw)))
    assert main(["demo", "--rl", *flags, "--quiet", "--work-dir", str(tmp_path)]) == 0
    expected = {"server": None, "settings": settings, "quiet": True, "run_id": "rl-demo"}
    assert calls == [((tmp_path,), expected)]
