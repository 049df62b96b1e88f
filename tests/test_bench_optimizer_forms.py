"""bench/optimizer_forms.py runs and prints both forms' times, quiet and beside busy threads:
measured, not tested (a bench nothing runs stops running unnoticed)."""

from __future__ import annotations

import re

from bench_runs import run_bench


def test_the_bench_times_both_forms_quiet_and_beside_busy_threads():
    stdout = run_bench("optimizer_forms.py", "--rounds", "1", "--busy", "1")
    figures = r"optim_step per-tensor +[\d.]+ ms, multi-tensor +[\d.]+ ms; ratio [\d.]+$"
    assert re.search(r"^quiet +: " + figures, stdout, re.M), stdout
    assert re.search(r"^1 busy threads +: " + figures, stdout, re.M), stdout
