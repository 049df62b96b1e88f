"""bench/engine.py runs on the tiny model and prints the engine's step beside a plain
transformers loop's, and its checkpoints beside raw safetensors: its figures are measured, not
tested; this checks that it still runs and that both sides trained the same weights."""

from __future__ import annotations

import re

import pytest
from bench_runs import bench_refusal, run_bench


@pytest.mark.slow  # four step comparisons and the checkpoint rounds: about 30 s on 2 cores
def test_the_tiny_models_engine_step_and_checkpoints_print_beside_the_plain_ones():
    stdout = run_bench(
        "engine.py", "--quick", "--model", "tiny", "--threads", "1", "--clock", "cpu"
    )
    for label in ("full 4x64", "lora r=16 4x64", "full 8x128", "lora r=16 8x128"):
        row = re.search(rf"^tiny {label} +[\d.]+ +[\d.]+ +\d+\.\d{{3}} .*$", stdout, re.M)
        assert row, stdout
        assert "too far" not in row.group(0), row.group(0)
    assert "thread CPU time" in stdout
    assert re.search(r"^load_state .* ratio +\d+\.\d\d$", stdout, re.M), stdout


@pytest.mark.slow  # the refusal comes after the bench imports torch: 5-20 s here
def test_cpu_time_is_refused_where_it_would_miss_other_threads_work():
    assert "--clock cpu needs --threads 1" in bench_refusal("engine.py", "--clock", "cpu")
