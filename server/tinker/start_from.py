"""Starting a run from a saved checkpoint, and the catalog record every run gets.

``create_training_client_from_state`` sends a ``load_weights`` with a session instead of a model:
the new run takes the saved run's configuration (its base model, LoRA settings, seed) and the
checkpoint's weights with a fresh optimizer, as ``load_weights`` does. ``..._with_optimizer``
takes the whole continuation state (moments, step, RNG), which only means the same thing under
the same configuration: a different base model or optimizer is refused with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.contract.outcomes import OperationSpec, WeightsSource
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.paths import resolve_under
from trainwire.server.service import operations as ops
from trainwire.server.service.host import SessionHost
from trainwire.server.service.requests import CheckpointRequest, LoadWeightsRequest
from trainwire.server.tinker.catalog import (
    Catalog,
    SavedCheckpoint,
    TinkerPath,
    TrainingRunRecord,
)
from trainwire.server.tinker.fields import get_bool, get_dict, get_str
from trainwire.server.tinker.model import fit_max_length

START_CHECKPOINT = "start"  # the first checkpoint of a run started from another's
SWITCHES = ("train_attn", "train_mlp", "train_unembed")
MAX_METADATA_ITEMS = 64  # user_metadata: a few labels (the cookbook writes two or three)
MAX_METADATA_CHARS = 1024  # per key or value


def lora_switches(body: dict[str, Any]) -> dict[str, bool]:
    """A ``create_model``'s LoRA switches as given (Tinker's defaults: all on)."""
    lora = get_dict(body, "lora_config") or {}
    return {name: get_bool(lora, name, True) for name in SWITCHES}


def user_metadata(body: dict[str, Any]) -> dict[str, str]:
    """The request's ``user_metadata``: string keys and values, bounded."""
    metadata = body.get("user_metadata") or {}
    if not isinstance(metadata, dict):
        raise InvalidArgument("user_metadata must be an object of strings")
    if len(metadata) > MAX_METADATA_ITEMS:
        raise InvalidArgument(f"user_metadata holds at most {MAX_METADATA_ITEMS} entries")
    for key, value in metadata.items():
        if not isinstance(value, str) or max(len(key), len(value)) > MAX_METADATA_CHARS:
            raise InvalidArgument(
                f"user_metadata {key[:40]!r}: keys and values are strings of at most "
                f"{MAX_METADATA_CHARS} characters"
            )
    return dict(metadata)


def run_record(
    model_id: str, config: TrainingConfig, switches: dict[str, bool], body: dict[str, Any]
) -> TrainingRunRecord:
    now = time.time()
    rank = config.lora.r if config.lora else None
    return TrainingRunRecord(
        model_id=model_id,
        base_model=config.model,
        lora_rank=rank,
        config=config.to_dict(),
        switches=switches if rank is not None else {},
        user_metadata=user_metadata(body),
        created_s=now,
        last_request_s=now,
    )


@dataclass(frozen=True)
class StartFrom:
    """Where a new run starts: ``source``'s checkpoint ``saved`` at ``path``."""

    path: TinkerPath
    source: TrainingRunRecord
    saved: SavedCheckpoint
    with_optimizer: bool
    base_model: str | None  # a different base model asked for (weights only)

    @classmethod
    def of(cls, body: dict[str, Any], catalog: Catalog) -> StartFrom:
        """The request checked against the catalog, before anything opens."""
        path = TinkerPath.parse(get_str(body, "path"))
        if path.segment != "weights":
            raise InvalidArgument(
                f"path {str(path)!r}: a run starts from a training checkpoint "
                "(tinker://<run>/weights/<name>, from save_state), not from sampler weights"
            )
        source, saved = catalog.find(path)
        with_optimizer = get_bool(body, "optimizer")
        base_model = get_str(body, "base_model") or None
        if base_model == source.base_model:
            base_model = None
        if with_optimizer and base_model is not None:
            raise FailedPrecondition(
                f"{path} was saved by a run of {source.base_model!r}; its optimizer state "
                f"continues that configuration only, not {base_model!r} "
                "(create_training_client_from_state loads the weights alone)"
            )
        optimizer = get_str(get_dict(body, "optimizer_config") or {}, "type", "adamw")
        if optimizer != "adamw":
            raise InvalidArgument(f"optimizer {optimizer!r}: this server runs adamw")
        return cls(path, source, saved, with_optimizer, base_model)

    def config(self, model_root: Path | None) -> TrainingConfig:
        """The new run's configuration: the saved run's (with the base model asked for)."""
        config = TrainingConfig.from_dict(self.source.config)
        if self.base_model is None:
            return config
        model_dir = resolve_under(model_root, self.base_model, "base_model")
        return fit_max_length(replace(config, model=self.base_model), model_dir)

    def apply(self, host: SessionHost, model_id: str, run_id: str) -> None:
        """Load the checkpoint into ``run_id``, the run just opened for ``model_id``, keyed (a
        retry finds it journaled)."""
        key = OperationSpec(f"{model_id}/from-state")
        saved_by = self.source.run_id
        if self.with_optimizer:
            load = CheckpointRequest(self.saved.stored_as, saved_by)
            host.apply(ops.LOAD_STATE, load, key, run_id=run_id)
            return
        source = WeightsSource("checkpoint", self.saved.stored_as)
        host.apply(ops.LOAD_WEIGHTS, LoadWeightsRequest(source, saved_by), key, run_id=run_id)
