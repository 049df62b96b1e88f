"""What the tests, the demo and the benchmarks share: tiny real models, tiny data, a free port.

It ships with the package (the demo needs it) and gathers the helpers by job:

- :mod:`trainwire.tiny_models`: :func:`make_tiny_model`, a real model and tokenizer, offline.
- :mod:`trainwire.tiny_architectures`: :func:`make_tiny_architecture`, a tiny random-init model of
  each architecture in :data:`ARCHITECTURES` (Qwen, Llama 3, Mistral, Gemma, Phi-3, GPT-2,
  gpt-oss, OLMo 2, BERT-style classifiers), with the same tokenizers.
- :mod:`trainwire.tiny_data`: :func:`tiny_sentiment_examples`, :func:`tiny_text_examples`,
  :func:`tiny_token_examples`.
- :func:`free_port`, here: a loopback port for a server started as a separate process, and
  :func:`wait_for_listener`, which waits until such a server listens.

What a caller may rely on: the same arguments give the same bytes (models) and the same examples
(data) on every run and machine, the caller's global RNGs are untouched, and importing this module
imports no torch (the model helpers import it when called).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import random
import socket
import tempfile
import time
from pathlib import Path

from trainwire.tiny_architectures import ARCHITECTURES, TinyArchitecture, make_tiny_architecture
from trainwire.tiny_data import (
    SENTIMENT_LABELS,
    tiny_sentiment_examples,
    tiny_text_examples,
    tiny_token_examples,
)
from trainwire.tiny_models import ARCHS, SHAPES, make_tiny_model

__all__ = [
    "ARCHITECTURES",
    "ARCHS",
    "SENTIMENT_LABELS",
    "SHAPES",
    "TinyArchitecture",
    "free_port",
    "make_tiny_architecture",
    "make_tiny_model",
    "tiny_sentiment_examples",
    "tiny_text_examples",
    "tiny_token_examples",
    "wait_for_listener",
]


_HANDED_OUT: set[tuple[str, int]] = set()  # by free_port, in this process
_CHOOSER = random.Random()  # its own stream: a caller's global RNGs stay untouched
_RESERVATIONS_FILE = Path(tempfile.gettempdir()) / f"trainwire-free-ports-{os.getuid()}.lock"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and kept from every other caller, for a server started as
    another process.

    An in-process server binds port 0 and reports its port; a ``trainwire serve`` subprocess (or a
    server restarted on the same address) needs its port before it starts, so one is picked here.
    Nothing else may take it in between, or while its server restarts, though test processes run
    side by side (pytest-xdist workers, several suites on one machine): the port lies outside the
    kernel's ephemeral range, so no ``bind(0)`` or outgoing connection is ever given it, and it is
    reserved with a lock on its byte of one shared file, which this process holds until it exits
    (the kernel drops the lock then, however the process ends). Every process that asks here skips
    a reserved port, and this one never hands out a port twice.
    """
    candidates = _ports_outside_the_ephemeral_range()
    while True:
        port = _CHOOSER.choice(candidates)
        if (host, port) in _HANDED_OUT or not _reserve(port):
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                continue  # something that does not ask here uses it
        _HANDED_OUT.add((host, port))
        return port


@functools.cache
def _ports_outside_the_ephemeral_range() -> list[int]:
    """The ports from 10000 up that the kernel never hands out for port 0 or an outgoing
    connection (outside ``ip_local_port_range``; Linux's default where it cannot be read), or
    all of them where that range leaves too few."""
    try:
        first, last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        first, last = 32768, 60999
    ports = [port for port in range(10000, 65536) if not first <= port <= last]
    return ports if len(ports) >= 1000 else list(range(10000, 65536))


@functools.cache
def _reservations() -> int:
    """The shared reservations file, open for this process's lifetime: closing any descriptor
    of it would drop every lock this process holds there."""
    return os.open(_RESERVATIONS_FILE, os.O_RDWR | os.O_CREAT, 0o600)


def _reserve(port: int) -> bool:
    """Lock byte ``port`` of the shared reservations file for this process, without waiting."""
    try:
        fcntl.lockf(_reservations(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:  # another process holds it
        return False
    return True


def wait_for_listener(target: str, timeout_s: float = 300.0) -> None:
    """Block until something accepts TCP connections at ``HOST:PORT`` (a server process that
    was just started binds its port a few seconds in): a client never reached a server that
    is not listening yet, and fails at once there instead of waiting."""
    host, _, port = target.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                message = f"nothing listened at {target} within {timeout_s:.0f}s"
                raise TimeoutError(message) from None
            time.sleep(0.05)
