"""bench/runs_together.py --service runs through a server and prints its figures: measured, not
tested (a bench nothing runs stops running unnoticed), but every run's digest must equal alone."""

from __future__ import annotations

import re

import pytest
from bench_runs import run_bench


@pytest.mark.slow  # a server, 3 runs of 3 steps on the tiny llama: about a minute on 2 loaded cores
def test_the_service_mode_steps_runs_together_over_grpc_and_every_digest_equals_alone():
    options = ["--service", "--shape", "tiny", "--runs", "2", "--steps", "2", "--rounds", "1"]
    stdout = run_bench("runs_together.py", *options)
    line = re.search(
        r"^service   : alone +[\d.]+ steps/s, 2 runs over gRPC +[\d.]+ steps/s in all; ratio "
        r"[\d.]+ \(goal >= 2\.0: (met|missed)\) .*; (\d+) shared passes .* held (\d+) of 4 "
        r"forward_backward calls; the first run done took [\d.]+ of the last one's time at "
        r"worst; digests equal to alone: 3/3$",
        stdout,
        re.M,
    )
    assert line is not None, stdout
