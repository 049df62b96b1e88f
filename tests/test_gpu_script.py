"""bench/gpu.sh, the one-command GPU qualification: its CPU-side behaviour (it refuses clearly)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_at_once_and_runs_nothing(tmp_path):
    results = tmp_path / "results"
    done = subprocess.run(
        ["bash", str(SCRIPT), str(results)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3
    assert "no CUDA device" in done.stderr and "nothing ran" in done.stderr
    assert not results.exists()


def test_every_test_file_and_benchmark_it_runs_exists():
    """The script runs on a GPU machine only: a renamed file would otherwise fail there first."""
    root = SCRIPT.parents[1]
    named = set(re.findall(r"\b((?:tests|bench)/[\w/]+\.py)\b", SCRIPT.read_text()))
    assert {
        "tests/test_tokens_cuda.py",
        "bench/engine.py",
        "bench/sampling.py",
        "bench/sharding.py",
        "bench/many_runs.py",
        "bench/many_runs_throughput.py",
        "bench/runs_together.py",
        "bench/samples_together.py",
    } <= named
    assert [path for path in sorted(named) if not (root / path).is_file()] == []
