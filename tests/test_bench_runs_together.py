"""bench/runs_together.py --service runs through a server and prints its figures: measured, not
tested (a bench nothing runs stops running unnoticed), but every run's digest must equal alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "runs_together.py"


@pytest.mark.slow  # a server, 3 runs of 3 steps on the tiny llama: about a minute on 2 loaded cores
def test_the_service_mode_steps_runs_together_over_grpc_and_every_digest_equals_alone():
    options = ["--service", "--shape", "tiny", "--runs", "2", "--steps", "2", "--rounds", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *options], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = re.search(
        r"^service   : alone +[\d.]+ steps/s, 2 runs over gRPC +[\d.]+ steps/s in all; ratio "
        r"[\d.]+ \(goal >= 2\.0: (met|missed)\) .*; (\d+) shared passes .* held (\d+) of 4 "
        r"forward_backward calls; the first run done took [\d.]+ of the last one's time at "
        r"worst; digests equal to alone: 3/3$",
        done.stdout,
        re.M,
    )
    assert line is not None, done.stdout
