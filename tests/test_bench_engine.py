"""bench/engine.py runs on the tiny model and prints the engine's step beside a plain
transformers loop's, and its checkpoints beside raw safetensors: its figures are measured, not
tested; this checks that it still runs and that both sides trained the same weights."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "engine.py"


@pytest.mark.slow  # four step comparisons and the checkpoint rounds: about 30 s on 2 cores
def test_the_tiny_models_engine_step_and_checkpoints_print_beside_the_plain_ones():
    command = [sys.executable, str(SCRIPT), "--quick", "--model", "tiny", "--threads", "1"]
    done = subprocess.run([*command, "--clock", "cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for label in ("full 4x64", "lora r=16 4x64", "full 8x128", "lora r=16 8x128"):
        row = re.search(rf"^tiny {label} +[\d.]+ +[\d.]+ +\d+\.\d{{3}} .*$", done.stdout, re.M)
        assert row, done.stdout
        assert "too far" not in row.group(0), row.group(0)
    assert "thread CPU time" in done.stdout
    assert re.search(r"^load_state .* ratio +\d+\.\d\d$", done.stdout, re.M), done.stdout


@pytest.mark.slow  # the refusal comes after the bench imports torch: 5-20 s here
def test_cpu_time_is_refused_where_it_would_miss_other_threads_work():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--clock", "cpu"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "--clock cpu needs --threads 1" in done.stderr
