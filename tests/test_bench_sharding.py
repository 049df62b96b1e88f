"""bench/sharding.py runs on the CPU and prints its ratios: its figures are measured, not tested."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sharding.py"


@pytest.mark.slow  # 3 spawned processes build 2 sessions each: about 20 s on 2 cores
def test_two_gloo_ranks_print_memory_and_step_time_ratios():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "tiny", "--warmup", "0", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Every parameter and moment of the tiny llama divides evenly over 2 ranks: each holds half
    # (plus the optimizer's whole step counts, too small to show).
    for mode in ("full", "lora"):
        assert re.search(rf"^{mode} max rank +ratio 0\.500: goal met$", done.stdout, re.M)
        assert re.search(rf"^{mode} +[\d.]+ +[\d.]+ +\d+\.\d{{3}}$", done.stdout, re.M)


@pytest.mark.slow  # its imports alone take 3-5 s here
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_runs():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--nproc", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--device cuda: CUDA is not available here" in done.stderr
