"""Resident memory that follows live memory: glibc's malloc told to hand freed memory back.

The queued-calls bound (``scheduler``) holds what decoded requests keep alive, but glibc keeps
the blocks a freed request leaves: the threshold above which it maps a block of its own rises to
the size of the largest block freed (up to 32 MiB), so later large blocks come from the heaps, and
each thread that decodes gets a heap of its own (up to eight per core) whose free space is only
returned from its top. A flood of maximal forward_backward calls then left the process far larger
than what it held (a review measured 2.8 GB after 60 of them). ``release_freed_memory`` fixes both
thresholds and bounds the heaps where ``trainwire serve`` starts (``mallopt``): blocks from 1 MiB
up are mapped and unmapped on their own, a heap's free top past 1 MiB is returned, and the threads
share a few heaps. Mapping a block costs its pages' first touch on every allocation; on CPU
training the benchmark (bench/resident_memory.py) saw no slower calls. A no-op off glibc, and where
``TRAINWIRE_KEEP_FREED_MEMORY=1`` (the benchmark's side without it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

KEEP_FREED_MEMORY_ENV = "TRAINWIRE_KEEP_FREED_MEMORY"
# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
# A block this large is mapped on its own, and unmapped when freed. Fixing it (any mallopt of it
# does) stops glibc from raising it to the size of each large block freed.
MMAP_THRESHOLD_BYTES = 1024 * 1024
# A heap's free top past this much is returned to the system.
TRIM_THRESHOLD_BYTES = 1024 * 1024
# Heaps the threads share (glibc's default: eight per core, each keeping its own free space).
ARENA_MAX = 4


def release_freed_memory() -> bool:
    """Set glibc's malloc to hand freed memory back to the system; True when it was set."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV) == "1":
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    settings = {
        M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES,
        M_TRIM_THRESHOLD: TRIM_THRESHOLD_BYTES,
        M_ARENA_MAX: ARENA_MAX,
    }
    applied = all(mallopt(parameter, value) == 1 for parameter, value in settings.items())
    if not applied:
        logger.warning("glibc refused a malloc setting: freed memory may stay resident")
    return applied


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None where the C library is another (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
