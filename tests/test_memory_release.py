"""The server's resident memory follows its live memory: after ``release_freed_memory`` (called
where ``trainwire serve`` starts), blocks a thread freed go back to the system instead of staying
in glibc's heaps (bench/resident_memory.py measures it on a real server)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from trainwire.server.memory_release import KEEP_FREED_MEMORY_ENV

BLOCKS, BLOCK_MIB = 64, 4  # 256 MiB held at once, then freed

# Run in a fresh interpreter: glibc's thresholds move with what the process allocated before.
# A thread frees an 8 MiB block (glibc then raises its mapping threshold to 8 MiB), allocates
# 64 blocks of 4 MiB and a small one after them (as decoded requests and a result leave a heap),
# and frees the 64: the RSS growth that stays is what glibc kept.
CHURN = textwrap.dedent(
    f"""
    import threading
    from pathlib import Path
    from trainwire.server.memory_release import release_freed_memory

    def rss_mib():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    released = release_freed_memory()
    before = rss_mib()
    kept = []

    def churn():
        del bytearray(8 << 20)[:]
        blocks = [bytearray({BLOCK_MIB} << 20) for _ in range({BLOCKS})]
        kept.append(bytearray(64 << 10))
        blocks.clear()

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    print(released, rss_mib() - before)
    """
)


def churn_growth_mib(keep_freed_memory: bool) -> tuple[bool, float]:
    env = {key: value for key, value in os.environ.items() if key != KEEP_FREED_MEMORY_ENV}
    if keep_freed_memory:
        env[KEEP_FREED_MEMORY_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; glibc's malloc")
def test_memory_a_thread_freed_goes_back_to_the_system() -> None:
    released, growth = churn_growth_mib(keep_freed_memory=False)
    held = BLOCKS * BLOCK_MIB
    assert growth < held / 8, f"{growth:.0f} MiB of {held} MiB freed stayed resident"
    assert released


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; glibc's malloc")
def test_without_the_setting_glibc_keeps_what_a_thread_freed() -> None:
    """The measurement above can fail: with the setting off, most of it stays."""
    released, growth = churn_growth_mib(keep_freed_memory=True)
    assert not released
    assert growth > BLOCKS * BLOCK_MIB / 2
