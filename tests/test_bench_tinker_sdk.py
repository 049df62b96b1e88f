"""bench/tinker_sdk.py runs against its two servers and prints its ratios: its figures are
measured, not tested. It once stopped running (the config it opened had outgrown the tiny model)
and nothing noticed until a measurement was due."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "tinker_sdk.py"


@pytest.mark.slow  # two servers, the SDK and 2 x 3 rounds of steps: about 30 s on 2 cores
def test_the_sdk_and_the_own_client_step_side_by_side_on_both_models():
    # Its own session, so a stall ends with the bench and both its servers killed; inside the
    # suite's 600 s, so the failure shows what they printed (the bench its stacks at 480 s).
    bench = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = bench.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGKILL)
        stdout, stderr = bench.communicate()
        pytest.fail(f"bench/tinker_sdk.py --quick ran past 540 s; it printed:\n{stdout}\n{stderr}")
    assert bench.returncode == 0, stderr[-20000:]
    for model in ("tiny", "small"):
        assert re.search(rf"^{model} +[\d.]+ +[\d.]+ +\d+\.\d{{3}} ", stdout, re.M), stdout
