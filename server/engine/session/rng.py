"""The session's own random state: Python, NumPy, torch CPU and CUDA generators.

Dropout and adapter initialization draw from the process-wide generators. A session keeps its
own snapshot and installs it around each of its operations, so two sessions in one process never
change each other's bits, and a checkpoint restores the exact continuation.

Of those, a session's operations draw from torch's generators only: no engine code and no model
it trains draws from Python's ``random`` or NumPy's global stream. Those two are installed as
seeded (for any code that might) but never taken back after an operation (``advanced``): what
another thread or a library does to them meanwhile (a draw on a first run only, say) is not the
session's, and must not change its digest.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class RngState:
    """A snapshot of every generator a training step may draw from."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor]

    @classmethod
    def capture(cls, *, cuda: bool = True) -> RngState:
        """The global generators' state; the CUDA ones only with ``cuda`` (and once CUDA is up).

        A CPU session leaves CUDA out: its bits never depend on those generators, and its state
        must not change shape when something else in the process initializes CUDA.
        """
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), _cuda(cuda))

    @classmethod
    def seeded(cls, seed: int, *, cuda: bool = True) -> RngState:
        """The state every generator has after seeding with ``seed``; globals untouched."""
        with preserved_global_rng():
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)  # seeds CUDA generators too, where initialized
            return cls.capture(cuda=cuda)

    def advanced(self, *, cuda: bool = True) -> RngState:
        """The state after an operation: torch's generators as it left them, Python's and
        NumPy's as this state installed them (the session never draws from those, so they are
        not read back: reading NumPy's alone takes tens of microseconds an operation)."""
        return RngState(self.python, self.numpy, torch.get_rng_state(), _cuda(cuda))

    def install(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda)

    # -- persistence: JSON for the Python/NumPy states, tensors for torch's -------------------

    def to_json(self) -> dict[str, Any]:
        version, internal, gauss = self.python
        name, keys, pos, has_gauss, cached = self.numpy
        return {
            "python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"torch_cpu": self.torch_cpu}
        out.update({f"cuda_{i}": state for i, state in enumerate(self.cuda)})
        return out

    @classmethod
    def from_parts(cls, data: dict[str, Any], tensors: dict[str, torch.Tensor]) -> RngState:
        version, internal, gauss = data["python"]
        name, keys, pos, has_gauss, cached = data["numpy"]
        cuda_count = sum(1 for key in tensors if key.startswith("cuda_"))
        return cls(
            python=(version, tuple(internal), gauss),
            numpy=(name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
            torch_cpu=tensors["torch_cpu"],
            cuda=[tensors[f"cuda_{i}"] for i in range(cuda_count)],
        )

    def update_digest(self, digest: Any) -> None:
        """Feed the state into a hashlib digest, so equal digests mean equal future draws."""
        digest.update(repr(self.to_json()).encode())
        for name, tensor in sorted(self.tensors().items()):
            digest.update(name.encode())
            digest.update(tensor.numpy().tobytes())

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        self.update_digest(digest)
        return digest.hexdigest()


def _cuda(cuda: bool) -> list[torch.Tensor]:
    """The CUDA generators' states, with ``cuda`` and once CUDA is up; else none."""
    return torch.cuda.get_rng_state_all() if cuda and torch.cuda.is_initialized() else []


# The torch, NumPy and Python generators are process-wide: every block that sets or draws from
# them on purpose holds this lock (``preserved_global_rng``), so such blocks on two threads take
# turns. Without it, a thread putting the generators back as it found them (after building a
# model skeleton for a create_model, say) would set them in the middle of another thread's
# operation, and that run would draw other numbers than it draws alone.
GLOBAL_RNG_LOCK = threading.RLock()


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Run a block holding ``GLOBAL_RNG_LOCK`` and put every global generator back as it was,
    whatever the block drew."""
    with GLOBAL_RNG_LOCK:
        saved = RngState.capture()
        try:
            yield
        finally:
            saved.install()
