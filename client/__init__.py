"""trainwire's client side: the gRPC session client (``session/``) and the controller that drives
a manifest's run (``control/``), with the contract's config, plan and manifest names re-exported
so ``from trainwire.client import TrainingConfig, ManagedTrainingPlan`` keeps working.

Importing this package never imports torch, numpy or transformers, so a CPU-only control plane
can plan and drive a CUDA bf16 run. It imports nothing heavy at all: each name below loads its
module on first use, so planning a run never pulls in grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainwire.client.control.controller import Controller
    from trainwire.client.session.custom_loss import forward_backward_custom
    from trainwire.client.session.errors import ServerUnreachable, SessionError
    from trainwire.client.session.session_client import SessionClient
    from trainwire.contract.config import InputExample, LoraSettings, TrainingConfig
    from trainwire.contract.outcomes import Sample
    from trainwire.contract.planning.manifest import (
        load_plan,
        read_config_file,
        read_examples_jsonl,
        read_manifest,
        write_manifest,
        write_plan_manifest,
    )
    from trainwire.contract.planning.overrides import parse_config_overrides
    from trainwire.contract.planning.plan import MANIFEST_FORMAT, ManagedTrainingPlan, Microbatch
    from trainwire.contract.tokens import TokenExample

_LAZY = {
    "InputExample": "trainwire.contract.config",
    "LoraSettings": "trainwire.contract.config",
    "TrainingConfig": "trainwire.contract.config",
    "load_plan": "trainwire.contract.planning.manifest",
    "read_config_file": "trainwire.contract.planning.manifest",
    "read_examples_jsonl": "trainwire.contract.planning.manifest",
    "read_manifest": "trainwire.contract.planning.manifest",
    "write_manifest": "trainwire.contract.planning.manifest",
    "write_plan_manifest": "trainwire.contract.planning.manifest",
    "parse_config_overrides": "trainwire.contract.planning.overrides",
    "MANIFEST_FORMAT": "trainwire.contract.planning.plan",
    "ManagedTrainingPlan": "trainwire.contract.planning.plan",
    "Microbatch": "trainwire.contract.planning.plan",
    "SessionClient": "trainwire.client.session.session_client",
    "SessionError": "trainwire.client.session.errors",
    "ServerUnreachable": "trainwire.client.session.errors",
    "TokenExample": "trainwire.contract.tokens",
    "Sample": "trainwire.contract.outcomes",
    "forward_backward_custom": "trainwire.client.session.custom_loss",
    "Controller": "trainwire.client.control.controller",
}

__all__ = [
    "MANIFEST_FORMAT",
    "Controller",
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
