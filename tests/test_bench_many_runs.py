"""bench/many_runs.py and bench/many_runs_throughput.py run and print their figures: they are
measured, not tested (a bench nothing runs stops running unnoticed); an option they cannot honour
is refused, never ignored."""

from __future__ import annotations

import re

import pytest
import torch
from bench_runs import bench_refusal, run_bench


@pytest.mark.slow  # a server and 8 runs of 6 steps: about 15 s on 2 cores
def test_eight_runs_step_beside_one_run_alone_and_their_shares_print():
    stdout = run_bench("many_runs_throughput.py", "--quick")
    assert re.search(r"^ratio interleaved / alone: \d+\.\d{3} ", stdout, re.M), stdout
    shares = re.search(r"^steps of each run when the first finished: \[([\d, ]+)\]", stdout, re.M)
    assert shares is not None, stdout
    counts = [int(count) for count in shares.group(1).split(", ")]
    assert len(counts) == 8 and max(counts) == 6, counts  # the first to finish ran all six


@pytest.mark.slow  # three processes import torch, transformers and peft: about 25 s on 2 cores
def test_the_memory_bench_measures_the_shape_asked_for_on_the_device_asked_for():
    options = ["--device", "cpu", "--shape", "tiny", "--runs", "2", "--quick"]
    stdout = run_bench("many_runs.py", *options)
    assert stdout.startswith("tiny llama (2 x 32), fp32, LoRA r=16 on every linear layer, 2 ")
    for name in ("alone-1", "shared-2", "alone-2"):
        assert re.search(rf"^{name} +[12] +[\d.]+ +[\d.]+ +[\d.]+$", stdout, re.M)
    ratio = r"^shared-2 / alone-1: RSS \d+\.\d{3} \(goal <= 1\.25: (met|missed)\), added "
    assert re.search(ratio, stdout, re.M), stdout


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        pytest.param(
            ["--shape", "qwen3-8b"],
            r"argument --shape: invalid choice: 'qwen3-8b'",
            id="unknown-shape",
        ),
        pytest.param(
            ["--device", "cuda", "--shape", "qwen2-0.5b"],
            r"--device cuda: CUDA is not available here",
            marks=[NO_GPU, pytest.mark.slow],  # the refusal imports torch: 3-5 s here
            id="cuda-without-a-gpu",
        ),
    ],
)
@pytest.mark.parametrize(
    "script", ["many_runs.py", "many_runs_throughput.py"], ids=lambda name: name[:-3]
)
def test_a_shape_or_device_it_cannot_run_is_refused_in_one_line(script, options, reason):
    stderr = bench_refusal(script, *options, "--quick")
    assert re.fullmatch(rf"{script}: error: {reason}[^\n]*\n", stderr), stderr
