"""bench/optimizer_forms.py runs and prints both forms' times, quiet and beside busy threads:
measured, not tested (a bench nothing runs stops running unnoticed)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "optimizer_forms.py"


def test_the_bench_times_both_forms_quiet_and_beside_busy_threads():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--busy", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = r"optim_step per-tensor +[\d.]+ ms, multi-tensor +[\d.]+ ms; ratio [\d.]+$"
    assert re.search(r"^quiet +: " + figures, done.stdout, re.M), done.stdout
    assert re.search(r"^1 busy threads +: " + figures, done.stdout, re.M), done.stdout
