"""bench/many_runs.py and bench/many_runs_throughput.py run and print their figures: they are
measured, not tested (a bench nothing runs stops running unnoticed); an option they cannot honour
is refused, never ignored."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPT = BENCH / "many_runs_throughput.py"
MEMORY_SCRIPT = BENCH / "many_runs.py"


@pytest.mark.slow  # a server and 8 runs of 6 steps: about 15 s on 2 cores
def test_eight_runs_step_beside_one_run_alone_and_their_shares_print():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^ratio interleaved / alone: \d+\.\d{3} ", done.stdout, re.M), done.stdout
    shares = re.search(
        r"^steps of each run when the first finished: \[([\d, ]+)\]", done.stdout, re.M
    )
    assert shares is not None, done.stdout
    counts = [int(count) for count in shares.group(1).split(", ")]
    assert len(counts) == 8 and max(counts) == 6, counts  # the first to finish ran all six


@pytest.mark.slow  # three processes import torch, transformers and peft: about 25 s on 2 cores
def test_the_memory_bench_measures_the_shape_asked_for_on_the_device_asked_for():
    options = ["--device", "cpu", "--shape", "tiny", "--runs", "2", "--quick"]
    done = subprocess.run(
        [sys.executable, str(MEMORY_SCRIPT), *options],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("tiny llama (2 x 32), fp32, LoRA r=16 on every linear layer, 2 ")
    for name in ("alone-1", "shared-2", "alone-2"):
        assert re.search(rf"^{name} +[12] +[\d.]+ +[\d.]+ +[\d.]+$", done.stdout, re.M)
    ratio = r"^shared-2 / alone-1: RSS \d+\.\d{3} \(goal <= 1\.25: (met|missed)\), added "
    assert re.search(ratio, done.stdout, re.M), done.stdout


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
@pytest.mark.parametrize("script", [MEMORY_SCRIPT, SCRIPT], ids=lambda path: path.stem)
def test_a_shape_or_device_it_cannot_run_is_refused_in_one_line(script, options, reason):
    done = subprocess.run(
        [sys.executable, str(script), *options, "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert re.fullmatch(rf"{script.name}: error: {reason}[^\n]*\n", done.stderr), done.stderr
