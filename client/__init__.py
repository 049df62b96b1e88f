"""trainwire's client side: config, plan, manifest, the gRPC client and the controller.

Importing this package never imports torch, numpy or transformers, so a CPU-only control plane
can plan and drive a CUDA bf16 run. It imports nothing heavy at all: each name below loads its
module on first use, so the engine can use the config and plan without pulling in grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwire.client.config import InputExample, LoraSettings, TrainingConfig
    from trainwire.client.custom_loss import forward_backward_custom
    from trainwire.client.errors import ServerUnreachable, SessionError
    from trainwire.client.manifest import (
        load_plan,
        read_config_file,
        read_examples_jsonl,
        read_manifest,
        write_manifest,
        write_plan_manifest,
    )
    from trainwire.client.outcomes import Sample
    from trainwire.client.overrides import parse_config_overrides
    from trainwire.client.plan import MANIFEST_FORMAT, ManagedTrainingPlan, Microbatch
    from trainwire.client.session_client import SessionClient
    from trainwire.client.tokens import TokenExample

_LAZY = {
    "InputExample": "trainwire.client.config",
    "LoraSettings": "trainwire.client.config",
    "TrainingConfig": "trainwire.client.config",
    "load_plan": "trainwire.client.manifest",
    "read_config_file": "trainwire.client.manifest",
    "read_examples_jsonl": "trainwire.client.manifest",
    "read_manifest": "trainwire.client.manifest",
    "write_manifest": "trainwire.client.manifest",
    "write_plan_manifest": "trainwire.client.manifest",
    "parse_config_overrides": "trainwire.client.overrides",
    "MANIFEST_FORMAT": "trainwire.client.plan",
    "ManagedTrainingPlan": "trainwire.client.plan",
    "Microbatch": "trainwire.client.plan",
    "SessionClient": "trainwire.client.session_client",
    "SessionError": "trainwire.client.errors",
    "ServerUnreachable": "trainwire.client.errors",
    "TokenExample": "trainwire.client.tokens",
    "Sample": "trainwire.client.outcomes",
    "forward_backward_custom": "trainwire.client.custom_loss",
}

__all__ = [
    "MANIFEST_FORMAT",
    "InputExample",
    "LoraSettings",
    "ManagedTrainingPlan",
    "Microbatch",
    "Sample",
    "ServerUnreachable",
    "SessionClient",
    "SessionError",
    "TokenExample",
    "TrainingConfig",
    "forward_backward_custom",
    "load_plan",
    "parse_config_overrides",
    "read_config_file",
    "read_examples_jsonl",
    "read_manifest",
    "write_manifest",
    "write_plan_manifest",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
