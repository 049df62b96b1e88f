"""Hashing tensors into a state digest (names, dtypes, shapes and the exact bytes), and the
session's digest cached per state version."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from trainwire.server.engine.session.operation_guard import OperationGuard


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw bytes (any dtype, bf16 included), without a copy where possible."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).cpu().numpy())


def update_with_tensors(digest: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """Feed named tensors into a hashlib digest in name order."""
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor_bytes(tensor))


class Digestible(Protocol):
    """A session's state that hashes to its state digest: one process's ``CheckpointContents``
    or a sharded session's ``ShardedContents``."""

    def state_digest(self) -> str: ...


class StateDigests:
    """The session's state digest, cached per state version.

    Computing it hashes every parameter, optimizer moment and pending gradient, while ``Info``
    reports it after each operation and every checkpoint and export records it; so it is
    computed once per state. The guard's version keys it: every state-changing operation bumps
    the version, and a read-only one (forward, sample) leaves every bit as it found it.
    """

    def __init__(self, guard: OperationGuard) -> None:
        self._guard = guard
        self._cached: tuple[int, str] | None = None

    def known(self) -> str:
        """The digest if it is cached for the current state, else "" (no lock, no hashing)."""
        cached = self._cached
        return cached[1] if cached is not None and cached[0] == self._guard.version else ""

    def held(self, contents: Callable[[], Digestible]) -> str:
        """The digest, hashing ``contents()`` unless it is cached, for a caller that holds the
        session's lock (or a helper thread working for one: a checkpoint hashes its contents
        while it writes them, under the lock its writer holds)."""
        value = self.known() or contents().state_digest()
        self._cached = (self._guard.version, value)
        return value

    def drop(self) -> None:
        self._cached = None
