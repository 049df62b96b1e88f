"""Hashing tensors into a state digest: names, dtypes, shapes and the exact bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


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
