"""bench/many_runs_throughput.py runs and prints its figures: they are measured, not tested (a
bench nothing runs stops running unnoticed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "many_runs_throughput.py"


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
