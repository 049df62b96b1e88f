"""The Tinker SDK examples run as a researcher runs them: their own process, the key in
``TINKER_API_KEY``, against a real server on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tinker_loops import KEY, tinker_server

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, base_url: str) -> str:
    env = {**os.environ, "TINKER_API_KEY": KEY}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), base_url, "llama"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_supervised_example_lowers_its_loss(tmp_path, model_root, tiny_llama) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        out = run_example("tinker_sl.py", handle.tinker.base_url)
        assert handle.session_host.info().state == "closed"  # the example closed its client
    losses = [float(x) for x in re.findall(r"loss (-?[\d.]+)", out)]
    # The mean loss per token starts near ln(500) (a fresh model's guess) and the adapter
    # memorizes the sentences: a fall by far more than run-to-run noise could give.
    assert len(losses) >= 2 and losses[0] > 5.0 and losses[-1] < losses[0] / 4, out
    assert "-> ' Paris" in out, out


@pytest.mark.slow
def test_the_rl_example_raises_its_reward(tmp_path, model_root, tiny_llama) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        out = run_example("tinker_rl.py", handle.tinker.base_url)
    rewards = [float(x) for x in re.findall(r"mean reward (-?[\d.]+)", out)]
    assert len(rewards) == 12, out
    # Seeded samples on CPU: the same run every time. A fresh model writes a digit in about
    # one token of 25; the last rounds write almost nothing else.
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.1 and last > first + 0.4, out
