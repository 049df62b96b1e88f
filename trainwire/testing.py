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

import socket
import time

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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` just now, for a server started as another process.

    An in-process server binds port 0 and reports its port; a ``trainwire serve`` subprocess (or a
    server restarted on the same address) needs its port before it starts, so one is picked here.
    Another process could take it in between; on loopback in a test that does not happen in
    practice. Within this process no port is handed out twice (a dispatch test once got the same
    port for two of its servers).
    """
    while True:  # the kernel may hand the same free port out twice in a row; this never does
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if (host, port) not in _HANDED_OUT:
            _HANDED_OUT.add((host, port))
            return port


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
