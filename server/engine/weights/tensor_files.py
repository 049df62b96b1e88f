"""Tensors in files and between tensor sets: safetensors and JSON only, checked before copied.

Checkpoints, exports and native model directories all go through here, so a planted pickle is
never unpickled and every copy into live tensors is staged first (an allocation failure happens
before any live tensor changed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trainwire.server.errors import InvalidArgument, NotFound


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], *, sync: bool = False) -> None:
    """Write ``tensors`` to a safetensors file; with ``sync``, fsync it before returning."""
    # safetensors refuses shared storage; contiguous CPU copies are what goes to disk anyway.
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, path)
    if sync:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on the CPU; anything else is refused, never unpickled."""
    # Named by folder and file, never by the server's full path: clients read these messages.
    if not path.is_file():
        raise NotFound(f"{path.name} is missing from {path.parent.name}")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise InvalidArgument(
            f"{path.parent.name}/{path.name}: not a readable safetensors file ({error})"
        ) from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def describe_mismatches(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    """Every name, shape and dtype difference between two tensor sets, saved vs now."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:5])}")
    for name in sorted(set(expected) & set(found)):
        want, got = expected[name], found[name]
        if want.shape != got.shape:
            problems.append(f"{name}: shape {tuple(got.shape)}, model has {tuple(want.shape)}")
        elif want.dtype != got.dtype:
            problems.append(f"{name}: dtype {got.dtype}, model has {want.dtype}")
    return "; ".join(problems[:10])


def copy_into(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each source into its live tensor; every source is moved to its device first, so an
    allocation failure happens before any live tensor has changed."""
    staged = [(live, source.to(live.device)) for live, source in pairs]
    with torch.no_grad():
        for live, source in staged:
            live.copy_(source)
