"""bench/service_threads.py runs and prints each side's wall time and where the server's CPU
went: measured, not tested (a bench nothing runs stops running unnoticed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "service_threads.py"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_the_bench_splits_the_engine_threads_cpu_and_names_the_other_threads():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "5", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^  in-process: wall [\d.]+, engine CPU [\d.]+$", done.stdout, re.M)
    for side in ("blocking", "pipelined"):
        line = rf"^  {side}: wall [\d.]+ \([\d.]+x in-process\); engine thread [\d.]+ = engine "
        assert re.search(line + r"work [\d.]+ \(", done.stdout, re.M), done.stdout
    assert "other server threads: " in done.stdout
