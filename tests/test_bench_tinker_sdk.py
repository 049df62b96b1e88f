"""bench/tinker_sdk.py runs against its two servers and prints its ratios: its figures are
measured, not tested. It once stopped running (the config it opened had outgrown the tiny model)
and nothing noticed until a measurement was due."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "tinker_sdk.py"


@pytest.mark.slow  # two servers, the SDK and 2 x 3 rounds of steps: about 30 s on 2 cores
def test_the_sdk_and_the_own_client_step_side_by_side_on_both_models():
    try:  # inside the suite's 600 s, so a stall shows what the bench and its servers printed
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=540
        )
    except subprocess.TimeoutExpired as stalled:
        pytest.fail(f"bench/tinker_sdk.py --quick ran past 540 s:\n{str(stalled.stderr)[-20000:]}")
    assert done.returncode == 0, done.stderr[-20000:]
    for model in ("tiny", "small"):
        assert re.search(rf"^{model} +[\d.]+ +[\d.]+ +\d+\.\d{{3}} ", done.stdout, re.M), (
            done.stdout
        )
