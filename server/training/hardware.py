"""Where a local run trains and at what precision, decided before anything is allocated."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trainwire.client.config import TrainingConfig

logger = logging.getLogger(__name__)

FULL_PRECISION = "32-true"
# The config's precision as Lightning names it. "-true" (not "-mixed"): the session already holds
# its weights in that dtype, and autocast would change the bits the engine computes.
LIGHTNING_PRECISION = {"fp32": FULL_PRECISION, "bf16": "bf16-true"}
GIB = 1024**3


@dataclass(frozen=True)
class HardwareInfo:
    """The device a run trains on, as detected.

    Attributes:
        accelerator: ``cuda``, ``mps`` or ``cpu``.
        precision: the Lightning precision the run uses there (``32-true``, ``bf16-true``).
        device_name: the GPU's name, or the accelerator for CPU and MPS.
        device_count: visible devices of that kind (a run uses one).
        torch_version, cuda_version: the software it runs on (cuda_version None without CUDA).
        memory: ``get_gpu_memory_info()`` at detection time, None without CUDA.
    """

    accelerator: str
    precision: str
    device_name: str
    device_count: int
    torch_version: str
    cuda_version: str | None = None
    memory: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect_hardware(
    log_info: bool = False, *, cuda_precision: str = FULL_PRECISION
) -> HardwareInfo:
    """CUDA, else MPS, else the CPU; ``cuda_precision`` on CUDA and ``32-true`` elsewhere.

    ``cuda_precision`` is the configured precision in Lightning's words
    (``LIGHTNING_PRECISION[config.precision]``); elsewhere a run computes in fp32.
    """
    if torch.cuda.is_available():
        info = HardwareInfo(
            accelerator="cuda",
            precision=cuda_precision,
            device_name=torch.cuda.get_device_name(0),
            device_count=torch.cuda.device_count(),
            torch_version=str(torch.__version__),
            cuda_version=torch.version.cuda,
            memory=get_gpu_memory_info(),
        )
    else:
        mps = torch.backends.mps.is_available()
        accelerator = "mps" if mps else "cpu"
        info = HardwareInfo(
            accelerator=accelerator,
            precision=FULL_PRECISION,
            device_name=accelerator,
            device_count=1,
            torch_version=str(torch.__version__),
        )
    if log_info:
        logger.info(
            "hardware: %s (%s x%d), precision %s, torch %s%s",
            info.accelerator,
            info.device_name,
            info.device_count,
            info.precision,
            info.torch_version,
            f", CUDA {info.cuda_version}" if info.cuda_version else "",
        )
    return info


def get_gpu_memory_info() -> dict[str, float] | None:
    """GPU 0's memory in GB (total, reserved, allocated, free) and utilization %; None without CUDA.

    ``free`` is what the driver reports free on the device (other processes included);
    ``utilization_percent`` is the share of the device in use.
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


def effective_precision(config: TrainingConfig, accelerator: str) -> str:
    """The Lightning precision a run of ``config`` uses on ``accelerator``.

    fp32 everywhere; bf16 only on a CUDA device with native bf16. Anything else raises
    ``ValueError`` before a model is loaded: never a silent downgrade.
    """
    if config.precision not in LIGHTNING_PRECISION:
        raise ValueError(f"precision {config.precision!r} is not supported; use fp32 or bf16")
    if config.precision == "fp32":
        return FULL_PRECISION
    if accelerator != "cuda":
        raise ValueError(
            f"precision {config.precision} needs a CUDA device; this run trains on {accelerator}. "
            "Use precision fp32 here (--set precision=fp32)"
        )
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(
            f"precision bf16: {torch.cuda.get_device_name(0)} has no native bf16; "
            "use precision fp32 (--set precision=fp32)"
        )
    return LIGHTNING_PRECISION[config.precision]
