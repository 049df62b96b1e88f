"""bench/sharding.py runs on the CPU and prints its ratios: its figures are measured, not tested."""

from __future__ import annotations

import re

import pytest
import torch
from bench_runs import bench_refusal, run_bench


@pytest.mark.slow  # 3 spawned processes build 2 sessions each: about 20 s on 2 cores
def test_two_gloo_ranks_print_memory_and_step_time_ratios():
    stdout = run_bench("sharding.py", "--size", "tiny", "--warmup", "0", "--steps", "1")
    # Every parameter and moment of the tiny llama divides evenly over 2 ranks: each holds half
    # (plus the optimizer's whole step counts, too small to show).
    for mode in ("full", "lora"):
        assert re.search(rf"^{mode} max rank +ratio 0\.500: goal met$", stdout, re.M)
        assert re.search(rf"^{mode} +[\d.]+ +[\d.]+ +\d+\.\d{{3}}$", stdout, re.M)


@pytest.mark.slow  # its imports alone take 3-5 s here
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_runs():
    stderr = bench_refusal("sharding.py", "--device", "cuda", "--nproc", "1")
    assert "--device cuda: CUDA is not available here" in stderr
