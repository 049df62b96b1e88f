"""bench/service_threads.py runs and prints each side's wall time and where the server's CPU
went: measured, not tested (a bench nothing runs stops running unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bench_runs import run_bench


@pytest.mark.slow  # a server process and 3 x 15 steps: about 15 s on 2 cores
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_the_bench_splits_the_engine_threads_cpu_from_the_engines_own_work():
    stdout = run_bench("service_threads.py", "--steps", "5", "--rounds", "1")
    assert re.search(r"^  in-process: wall [\d.]+, engine CPU [\d.]+$", stdout, re.M)
    for side in ("blocking", "pipelined"):
        line = rf"^  {side}: wall [\d.]+ \([\d.]+x in-process\); engine thread [\d.]+ = engine "
        assert re.search(line + r"work [\d.]+ \(", stdout, re.M), stdout
    assert "other server threads: " in stdout
