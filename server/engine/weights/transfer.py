"""Weights in and out of a live model: ``load_weights`` sources and ``export_weights``.

Every source is read completely and checked (names, shapes, dtypes, adapter settings, base
model) before a single live tensor is touched, so a refused load changes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainwire.contract.config import TrainingConfig, setting_differences
from trainwire.contract.files import atomic_directory
from trainwire.server.engine.session.checkpoint import (
    MODEL_FILE,
    is_session_checkpoint,
    read_provenance,
    read_session_json,
)
from trainwire.server.engine.session.digest import update_with_tensors
from trainwire.server.engine.weights.layout import in_live_layout, tied_aliases
from trainwire.server.engine.weights.model_loading import MODEL_CONFIG_FILE
from trainwire.server.engine.weights.module_roles import holds_experts
from trainwire.server.engine.weights.tensor_files import (
    copy_into,
    describe_mismatches,
    load_tensors,
    write_json,
)
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound

EXPORT_FORMAT = "trainwire.export/v1"
EXPORT_FILE = "trainwire_export.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# The adapter config's fields PEFT holds as sets (and writes in set order).
WEIGHT_SETTINGS = ("task", "labels", "lora")  # what a checkpoint's weights must share
PEFT_SET_FIELDS = ("target_modules", "exclude_modules")
SHARD_INDEX_FILE = "model.safetensors.index.json"
PEFT_PREFIX = "base_model.model."
Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (live, source), as ``copy_into`` takes them


def native_name(live_name: str) -> str | None:
    """The name a native (non-PEFT) model gives a live parameter; None for adapter weights."""
    if "lora_" in live_name:
        return None
    name = live_name.removeprefix(PEFT_PREFIX)
    # PEFT nests one wrapper per adapted parameter of a module (an experts module with both its
    # projections adapted is ``experts.base_layer.base_layer.gate_up_proj``): strip them all.
    previous = None
    while name != previous:
        previous = name
        for wrapper in (".base_layer.", ".original_module.", ".modules_to_save.default."):
            name = name.replace(wrapper, ".")
    return name


def read_native_model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """A native model directory's weights, single-file or sharded safetensors."""
    single = directory / MODEL_FILE
    if single.is_file():
        return load_tensors(single)
    index_path = directory / SHARD_INDEX_FILE
    if not index_path.is_file():
        raise InvalidArgument(
            f"{directory.name}: no {MODEL_FILE} or {SHARD_INDEX_FILE}; only safetensors weights "
            "load"
        )
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError) as error:
        raise InvalidArgument(f"{index_path}: not a safetensors shard index ({error})") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = (directory / shard).resolve()
        if shard_path.parent != directory.resolve():
            raise InvalidArgument(f"{index_path}: shard {shard!r} lies outside the model directory")
        tensors.update(load_tensors(shard_path))
    return tensors


def plan_native_load(
    model: torch.nn.Module, source: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each live non-adapter parameter with its source tensor, or refuse the whole load.

    ``source`` is a native directory's tensors as its files name them; they are brought into the
    live layout first, by the mapping ``from_pretrained`` uses (fused experts, renamed weights
    such as ``LayerNorm.gamma``, the base model prefix), so every layout ``from_pretrained``
    accepts loads here too.
    """
    live = {name: p for name, p in model.named_parameters() if native_name(name) is not None}
    by_native: dict[str, list[torch.Tensor]] = {}
    for name, parameter in live.items():
        by_native.setdefault(native_name(name), []).append(parameter)
    expected = {name: params[0] for name, params in by_native.items()}
    source = in_live_layout(model, source, expected, tied_aliases(model, native_name))
    problems = describe_mismatches(expected, source)
    if problems:
        raise InvalidArgument(f"the weights do not fit this model: {problems}")
    return [(param, source[name]) for name, params in by_native.items() for param in params]


def plan_checkpoint_load(
    model: torch.nn.Module, checkpoint: Path
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    source = load_tensors(checkpoint / MODEL_FILE)
    live = dict(model.named_parameters())
    problems = describe_mismatches(live, source)
    if problems:
        raise InvalidArgument(f"checkpoint {checkpoint.name} does not fit this model: {problems}")
    return [(live[name], source[name]) for name in live]


def check_checkpoint_settings(checkpoint: Path, config: TrainingConfig) -> None:
    """A checkpoint's weights fit only a session of the same task, labels and LoRA settings
    (equal shapes are not enough: another alpha would rescale the adapter silently)."""
    check_saved_settings(checkpoint.name, read_session_json(checkpoint).get("config", {}), config)


def check_saved_settings(name: str, saved: Any, config: TrainingConfig) -> None:
    """``check_checkpoint_settings`` on the config checkpoint ``name`` recorded, whichever
    format recorded it (a sharded checkpoint's ``session.json`` holds it too)."""
    if not isinstance(saved, dict):
        raise InvalidArgument(f"{name}: malformed session.json (no config)")
    now = config.to_dict()
    differences = setting_differences(
        {key: saved[key] for key in WEIGHT_SETTINGS if key in saved},
        {key: now[key] for key in WEIGHT_SETTINGS},
    )
    if differences:
        raise InvalidArgument(
            f"checkpoint {name} was trained with other settings: " + "; ".join(differences)
        )


def adapter_settings_mismatches(model: torch.nn.Module, saved: dict[str, Any]) -> list[str]:
    """Where a saved adapter's settings differ from the live adapter's, saved vs now."""
    now = model.peft_config["default"]
    pairs = {
        "r": (saved.get("r"), now.r),
        "alpha": (saved.get("lora_alpha"), now.lora_alpha),
        "dropout": (saved.get("lora_dropout"), now.lora_dropout),
        "target_modules": (
            sorted(_as_list(saved.get("target_modules"))),
            sorted(_as_list(now.target_modules)),
        ),
        "use_dora": (bool(saved.get("use_dora", False)), bool(now.use_dora)),
        "target_parameters": (
            sorted(_as_list(saved.get("target_parameters"))),
            sorted(_as_list(getattr(now, "target_parameters", None))),
        ),
    }
    return [f"{key}: saved {a!r}, now {b!r}" for key, (a, b) in pairs.items() if a != b]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def plan_adapter_load(
    model: torch.nn.Module, directory: Path, base_fingerprint: str | None
) -> dict[str, torch.Tensor]:
    """Check a PEFT adapter directory against the live adapter; returns its tensors."""
    from peft import get_peft_model_state_dict

    if base_fingerprint is None or not hasattr(model, "peft_config"):
        raise FailedPrecondition(
            f"{directory.name} is a LoRA adapter, but this session trains full weights; open the "
            "session with lora settings to load it"
        )
    try:
        saved = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
    except ValueError as error:
        raise InvalidArgument(
            f"{directory.name}/{ADAPTER_CONFIG_FILE}: invalid JSON ({error})"
        ) from None
    mismatches = adapter_settings_mismatches(model, saved)
    if mismatches:
        raise InvalidArgument(f"adapter {directory.name} does not match: {'; '.join(mismatches)}")
    record = read_export_record(directory)
    if record is not None and record.get("base_model_fingerprint") != base_fingerprint:
        raise InvalidArgument(
            f"adapter {directory.name} was trained on another base model: saved "
            f"{record.get('base_model_fingerprint')}, now {base_fingerprint}"
        )
    tensors = load_tensors(directory / ADAPTER_WEIGHTS_FILE)
    problems = describe_mismatches(get_peft_model_state_dict(model), tensors)
    if problems:
        raise InvalidArgument(f"adapter {directory.name} does not fit this model: {problems}")
    return tensors


def load_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    with torch.no_grad():
        set_peft_model_state_dict(model, tensors)


@dataclass(frozen=True)
class WeightsLoad:
    """A ``load_weights`` source, read completely and checked, not yet applied."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # live, source
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)

    def apply(self, model: torch.nn.Module) -> None:
        if self.adapter:
            load_adapter_tensors(model, self.adapter)
        else:
            copy_into(self.pairs)


def plan_weights_load(
    model: torch.nn.Module, source: Path, config: TrainingConfig, base_fingerprint: str | None
) -> WeightsLoad:
    """Read and check a session checkpoint, a native model or a PEFT adapter at ``source``."""
    kind = source_kind(source)
    if kind == "checkpoint":
        check_checkpoint_settings(source, config)
        return WeightsLoad(pairs=plan_checkpoint_load(model, source))
    if kind == "native":
        return WeightsLoad(pairs=plan_native_load(model, read_native_model_tensors(source)))
    return WeightsLoad(adapter=plan_adapter_load(model, source, base_fingerprint))


def base_model_fingerprint(model: torch.nn.Module, config: TrainingConfig) -> str | None:
    """For LoRA: sha256 of the frozen base weights an adapter is trained on (None in full)."""
    if config.lora is None:
        return None
    digest = hashlib.sha256()
    base = {
        native_name(name): p
        for name, p in model.named_parameters()
        if native_name(name) is not None
        and ".modules_to_save." not in name
        and ".original_module." not in name
    }
    update_with_tensors(digest, base)
    return "sha256:" + digest.hexdigest()


def source_kind(directory: Path) -> str:
    """``checkpoint``, ``adapter`` or ``native`` by the files a directory holds."""
    if not directory.is_dir():
        raise NotFound(f"no weights at {directory.name!r}")
    if is_session_checkpoint(directory):
        return "checkpoint"
    if (directory / ADAPTER_CONFIG_FILE).is_file():
        return "adapter"
    if (directory / MODEL_CONFIG_FILE).is_file():
        return "native"
    raise InvalidArgument(
        f"{directory.name!r} is neither a session checkpoint, a PEFT adapter nor a model directory"
    )


def read_export_record(directory: Path) -> dict[str, Any] | None:
    path = directory / EXPORT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


# The kernels a session ran, by their key in config.json and their attribute on the config.
KERNEL_KEYS = {
    "attn_implementation": "_attn_implementation",
    "experts_implementation": "_experts_implementation",
}


def record_attention_implementation(directory: Path, model: torch.nn.Module) -> None:
    """Write the attention (and experts) kernels the session ran into the export's
    ``config.json``.

    ``save_pretrained`` leaves them out, so a reload would pick the defaults (sdpa attention,
    grouped experts), whose logits and gradients differ in the last bits from the eager kernels
    a session may have trained with; the export then would not reproduce the session's losses
    exactly.
    """
    kernels = {
        key: getattr(model.config, attribute, None) for key, attribute in KERNEL_KEYS.items()
    }
    kernels = {key: value for key, value in kernels.items() if isinstance(value, str) and value}
    if not holds_experts(model):
        kernels.pop("experts_implementation", None)  # a dense model's config stays as it was
    if not kernels:
        return
    config_path = directory / MODEL_CONFIG_FILE
    data = json.loads(config_path.read_text())
    data.update(kernels)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def order_adapter_config(directory: Path) -> None:
    """Write the sets in the adapter's ``adapter_config.json`` as sorted lists.

    PEFT keeps ``target_modules`` (and the like) as Python sets and writes them in set order,
    which follows the process's string-hash seed: the same adapter would give other bytes in
    another process. Sorted, the same weights give the same export files anywhere; PEFT reads
    them back into the same sets.
    """
    config_path = directory / ADAPTER_CONFIG_FILE
    data = json.loads(config_path.read_text())
    for key in PEFT_SET_FIELDS:
        value = data.get(key)
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            data[key] = sorted(value)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True))


def write_export(
    path: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    config: TrainingConfig,
    provenance: dict[str, Any],
) -> None:
    """A directory ``transformers`` (full) or ``peft`` (adapter) loads for inference;
    ``provenance`` (base model, step, state digest, source checkpoint) goes in its record."""
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if config.lora is None:
            record_attention_implementation(tmp, model)
        else:
            order_adapter_config(tmp)
        tokenizer.save_pretrained(tmp)
        write_json(
            tmp / EXPORT_FILE,
            {
                "format": EXPORT_FORMAT,
                "kind": "adapter" if config.lora is not None else "full",
                "config": config.to_dict(),
                "config_fingerprint": config.fingerprint(),
                **provenance,
            },
        )


def export_checkpoint(
    checkpoint: Path,
    path: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    config: TrainingConfig,
    narrow: Callable[[Pairs], Pairs] | None = None,
) -> None:
    """Export ``checkpoint``'s weights through ``model``, a detached copy the caller owns;
    ``narrow`` returns the part of the load that may really be copied into it (a copy that
    shares a base with other sessions takes its own tensors only)."""
    # The checkpoint's own provenance: a load_weights since may have changed the live base.
    provenance = read_provenance(checkpoint)
    pairs = plan_checkpoint_load(model, checkpoint)
    copy_into(pairs if narrow is None else narrow(pairs))
    # The name, not the path: the same weights give the same export files anywhere.
    provenance["checkpoint"] = checkpoint.name
    write_export(path, model, tokenizer, config, provenance)
