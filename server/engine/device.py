"""Where a session runs and at what precision, decided before anything is allocated."""

from __future__ import annotations

import os

import torch

from trainwire.contract.config import TrainingConfig
from trainwire.server.errors import InvalidArgument


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The requested device, or CUDA where there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidArgument(f"device {device!r}: {error}; use cpu or cuda") from None
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device {resolved}: only cpu and cuda are supported")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {resolved}: CUDA is not available on this machine")
    return resolved


def resolve_dtype(config: TrainingConfig, device: torch.device) -> torch.dtype:
    """fp32 everywhere; bf16 only on a CUDA device with native bf16. Never a silent downgrade."""
    if config.precision == "fp32":
        return torch.float32
    if config.precision == "bf16":
        if device.type != "cuda":
            raise InvalidArgument(
                f"precision bf16 needs a CUDA device; this session runs on {device.type}. "
                "Use precision fp32 here."
            )
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            raise InvalidArgument(
                f"precision bf16: {torch.cuda.get_device_name(device)} has no native bf16; "
                "use precision fp32"
            )
        return torch.bfloat16
    raise InvalidArgument(f"precision {config.precision!r} is not supported; use fp32 or bf16")


def refuse_unsupported_setups() -> None:
    """Distributed training changes the bits a run produces: refused, whether a process group is
    up or a launcher (torchrun) set a world size. The engine itself never compiles graphs."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.strip() not in ("", "1"):
        raise InvalidArgument(
            f"WORLD_SIZE={world_size}: trainwire sessions run on one device in one process; "
            "start the server without a distributed launcher"
        )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise InvalidArgument(
            "a distributed process group is initialized; trainwire sessions run on one device"
        )
