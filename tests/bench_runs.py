"""Running a benchmark script the way its tests do: in this interpreter, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_bench(script: str, *options: str, timeout_s: int = 600) -> str:
    """``bench/<script>`` with ``options``: its stdout, once it exited 0 (else the test fails
    with the end of its stderr)."""
    done = _run(script, options, timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def bench_refusal(script: str, *options: str, timeout_s: int = 120) -> str:
    """``bench/<script>`` with ``options`` it must refuse: its stderr, once it exited 2 (an
    argparse error) and printed nothing else."""
    done = _run(script, options, timeout_s)
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout)
    return done.stderr


def _run(script: str, options: tuple[str, ...], timeout_s: int) -> subprocess.CompletedProcess:
    command = [sys.executable, str(BENCH / script), *options]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
