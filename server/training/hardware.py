"""Where a local run trains and at what precision, decided before anything is allocated."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trainwire.contract.config import TrainingConfig

logger = logging.getLogger(__name__)

FULL_PRECISION = "32-true"
# The config's precision as Lightning names it. "-true" (not "-mixed"): the session already holds
# its weights in that dtype, and autocast would change the bits the engine computes.
LIGHTNING_PRECISION = {"fp32": FULL_PRECISION, "bf16": "bf16-true"}
GIB = 1024**3


@dataclass(frozen=True)
class HardwareInfo:
    """The device a run trains on, as detected.

    The first four fields are the seed's, in its order; the rest have defaults.

    Attributes:
        accelerator: ``cuda``, ``mps`` or ``cpu``.
        precision: the Lightning precision the trainer runs at: the requested CUDA precision
            on CUDA, ``32-true`` elsewhere.
        num_devices: visible devices of that kind (a run uses one).
        gpu_memory: ``get_gpu_memory_info()`` at detection time, None without CUDA.
        device_name: the GPU's name, or the accelerator for CPU and MPS.
        torch_version, cuda_version: the software it runs on (cuda_version None without CUDA).
    """

    accelerator: str
    precision: str
    num_devices: int
    gpu_memory: dict[str, float] | None = None
    device_name: str = ""
    torch_version: str = ""
    cuda_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_hardware(log_info: bool = False, *, cuda_precision: str = "bf16-mixed") -> HardwareInfo:
    """Detect the accelerator (CUDA, else MPS, else the CPU) and the precision it runs at.

    Args:
        log_info: log what was found (accelerator, device, precision, software).
        cuda_precision: the Lightning precision on CUDA (the seed's default, ``bf16-mixed``);
            ``trainwire train`` passes its config's, ``LIGHTNING_PRECISION[config.precision]``.
            Off CUDA the trainer runs at ``32-true``.

    Returns:
        The accelerator, precision, device count and GPU memory (None without CUDA).

    This reports; it never decides for a run: ``effective_precision`` is what a run trains at,
    and it refuses bf16 off CUDA instead of downgrading it (see there).

    Example:
        >>> hw = detect_hardware(log_info=True, cuda_precision="bf16-mixed")
        >>> print(f"Training on {hw.accelerator} with {hw.precision} precision")
    """
    torch_version = str(torch.__version__)
    if torch.cuda.is_available():
        info = HardwareInfo(
            accelerator="cuda",
            precision=cuda_precision,
            num_devices=torch.cuda.device_count(),
            gpu_memory=get_gpu_memory_info(),
            device_name=torch.cuda.get_device_name(0),
            torch_version=torch_version,
            cuda_version=torch.version.cuda,
        )
    else:
        accelerator = "mps" if torch.backends.mps.is_available() else "cpu"
        info = HardwareInfo(
            accelerator=accelerator,
            precision=FULL_PRECISION,
            num_devices=1,
            device_name=accelerator,
            torch_version=torch_version,
        )
    if log_info:
        logger.info(
            "hardware: %s (%s x%d), precision %s, torch %s%s",
            info.accelerator,
            info.device_name,
            info.num_devices,
            info.precision,
            info.torch_version,
            f", CUDA {info.cuda_version}" if info.cuda_version else "",
        )
    return info


def get_gpu_memory_info() -> dict[str, float] | None:
    """GPU 0's memory in GB (total, reserved, allocated, free) and utilization %; None without CUDA.

    ``free_gb`` is what the driver reports free on the device (other processes included);
    ``utilization_percent`` is the share of the device in use.

    Example:
        >>> info = get_gpu_memory_info()
        >>> if info:
        ...     print(f"GPU Memory: {info['free_gb']:.1f} GB free")
    """
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    return {
        "total_gb": round(total / GIB, 3),
        "reserved_gb": round(torch.cuda.memory_reserved(0) / GIB, 3),
        "allocated_gb": round(torch.cuda.memory_allocated(0) / GIB, 3),
        "free_gb": round(free / GIB, 3),
        "utilization_percent": round(100.0 * (total - free) / total, 1) if total else 0.0,
    }


def effective_precision(cfg: TrainingConfig, accelerator: str) -> str:
    """The Lightning precision a run of ``cfg`` trains at on ``accelerator``.

    fp32 (``32-true``) everywhere; bf16 (``bf16-true``) only on a CUDA device with native bf16.
    One deliberate difference from the seed, which runs ``32-true`` off CUDA whatever the config
    says: bf16 off CUDA (or on a GPU without native bf16) raises ``ValueError`` before a model
    is loaded. The session's rule wins: never a silent downgrade.

    Args:
        cfg: the run's configuration.
        accelerator: ``cuda``, ``mps`` or ``cpu``.
    """
    if cfg.precision not in LIGHTNING_PRECISION:
        raise ValueError(f"precision {cfg.precision!r} is not supported; use fp32 or bf16")
    if cfg.precision == "fp32":
        return FULL_PRECISION
    if accelerator != "cuda":
        raise ValueError(
            f"precision {cfg.precision} needs a CUDA device; this run trains on {accelerator}. "
            "Use precision fp32 here (--set precision=fp32)"
        )
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(
            f"precision bf16: {torch.cuda.get_device_name(0)} has no native bf16; "
            "use precision fp32 (--set precision=fp32)"
        )
    return LIGHTNING_PRECISION[cfg.precision]
