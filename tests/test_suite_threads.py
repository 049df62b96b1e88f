"""The suite's processes all run torch on the CPU thread count the environment names (conftest.py
sets ``OMP_NUM_THREADS``): a CPU computation's bits depend on it, and the suite compares bits
computed here with bits computed in the servers, ranks and scripts its tests start."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def test_torch_here_and_in_a_started_process_use_the_thread_count_the_environment_names():
    here = torch.get_num_threads()
    assert here <= int(os.environ["OMP_NUM_THREADS"])  # torch takes no more than the cores
    started = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert int(started.stdout) == here
