"""trainwire's client side: config, plan, manifest, and (soon) the gRPC client and controller.

Importing this package never imports torch, numpy or transformers, so a CPU-only control plane
can plan and drive a CUDA bf16 run.
"""

from trainwire.client.config import InputExample, LoraSettings, TrainingConfig
from trainwire.client.manifest import (
    load_plan,
    read_config_file,
    read_examples_jsonl,
    read_manifest,
    write_manifest,
    write_plan_manifest,
)
from trainwire.client.overrides import parse_config_overrides
from trainwire.client.plan import MANIFEST_FORMAT, ManagedTrainingPlan, Microbatch
from trainwire.client.session_client import SessionClient

__all__ = [
    "MANIFEST_FORMAT",
    "InputExample",
    "LoraSettings",
    "ManagedTrainingPlan",
    "Microbatch",
    "SessionClient",
    "TrainingConfig",
    "load_plan",
    "parse_config_overrides",
    "read_config_file",
    "read_examples_jsonl",
    "read_manifest",
    "write_manifest",
    "write_plan_manifest",
]
