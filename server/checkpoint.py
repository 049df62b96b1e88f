"""Session checkpoints on disk: one directory, written atomically, holding no pickle.

Layout (names are constants, defined once here):

    session.json            format, config and fingerprint, step, accumulation counter, device
                            type, base-model fingerprint, RNG (Python, NumPy), extra state
    model.safetensors       every parameter, by its live name
    optimizer.safetensors   AdamW moments and step counts, as ``<param index>.<name>``
    gradients.safetensors   pending (accumulated, not yet applied) gradients
    rng.safetensors         torch CPU and CUDA generator states
    trainer.safetensors     the session trainer's own state (a custom trainer's buffers)

Everything loads with safetensors or JSON only: a planted pickle is never unpickled.
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

CHECKPOINT_FORMAT = "trainwire.checkpoint/v1"
SESSION_FILE = "session.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
GRADIENTS_FILE = "gradients.safetensors"
RNG_FILE = "rng.safetensors"
TRAINER_FILE = "trainer.safetensors"


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], *, sync: bool = False) -> None:
    """Write ``tensors`` to a safetensors file; with ``sync``, fsync it before returning."""
    # safetensors refuses shared storage; contiguous CPU copies are what goes to disk anyway.
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, path)
    if sync:
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on the CPU; anything else is refused, never unpickled."""
    if not path.is_file():
        raise NotFound(f"{path.name} is missing from {path.parent}")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as error:
        raise InvalidArgument(f"{path}: not a readable safetensors file ({error})") from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def read_session_json(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's metadata; NotFound when there is no checkpoint there."""
    meta_path = checkpoint / SESSION_FILE
    if not checkpoint.is_dir():
        raise NotFound(f"no checkpoint at {checkpoint}")
    if not meta_path.is_file():
        raise InvalidArgument(f"{checkpoint} is not a session checkpoint (no {SESSION_FILE})")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as error:
        raise InvalidArgument(f"{meta_path}: not valid JSON ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise InvalidArgument(f"{checkpoint}: not a {CHECKPOINT_FORMAT} checkpoint")
    return meta


def is_session_checkpoint(path: Path) -> bool:
    return (path / SESSION_FILE).is_file()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state as flat ``<index>.<name>`` tensors."""
    tensors = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            tensors[f"{index}.{name}"] = value
    return tensors


def optimizer_state_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> dict[int, dict[str, torch.Tensor]]:
    """Check flat ``<index>.<name>`` tensors against the optimizer's parameters and return
    per-parameter state the optimizer may own, on each parameter's device.

    Owned copies, because a CPU tensor from ``load_file`` maps the checkpoint file, and a file
    rewritten in place after the load must never reach a live session.
    """
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in sorted(tensors.items()):
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) >= len(parameters) or not name:
            raise InvalidArgument(
                f"the checkpoint's optimizer state {key!r} names a parameter this model lacks"
            )
        parameter = parameters[int(index)]
        if name == "step":  # AdamW keeps its step counts on the CPU and moves them itself
            state.setdefault(int(index), {})[name] = value.clone()
            continue
        if value.shape != parameter.shape or value.dtype != parameter.dtype:
            raise InvalidArgument(
                f"the checkpoint's optimizer state {key!r} is {value.dtype} "
                f"{tuple(value.shape)}; its parameter is {parameter.dtype} "
                f"{tuple(parameter.shape)}"
            )
        state.setdefault(int(index), {})[name] = value.to(parameter.device, copy=True)
    return state


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[int, dict[str, torch.Tensor]]
) -> None:
    """Install checked per-parameter state; the groups' settings come from the (identical)
    config."""
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
