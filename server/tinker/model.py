"""What ``create_model`` becomes: the SDK's model request as a trainwire ``TrainingConfig``, and
the record the front keeps of each model it serves.

The run's optimizer settings are Tinker's ``AdamParams`` defaults (beta1 0.9, beta2 0.95, eps
1e-12, no weight decay, no clipping); every SDK ``optim_step`` names its own values, and each
applies to that update (``adam_settings``), journaled and replayed with it. The schedule is
constant: every step names its own learning rate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from trainwire.contract.config import LoraSettings, TrainingConfig
from trainwire.contract.files import write_text_atomic
from trainwire.contract.model_ids import run_id_for
from trainwire.server.errors import InvalidArgument
from trainwire.server.service.capabilities import LORA_ROLES, lora_role_targets
from trainwire.server.tinker.fields import get_bool, get_dict, get_int, get_setting, get_str

# Tinker scales every adapter by alpha / rank with alpha fixed at 32, whatever the rank (the
# "LoRA Without Regret" recipe: a good learning rate then barely depends on the rank).
LORA_ALPHA = 32
# Until the model's layers for the LoRA switches (train_<role>) are known (fit_lora_roles), a
# config names each role as ROLE_PREFIX + role.
ROLE_PREFIX = "role:"
ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}
MAX_LENGTH = 32768  # tokens per datum, or the model's positions where it has fewer
MODELS_DIR = "models"  # one file per open model, by its run id


@dataclass(frozen=True)
class ModelRecord:
    """A model this front serves: enough to answer get_info and to find its run after a
    restart (one file per open model, removed when it closes)."""

    model_id: str
    run_id: str
    session_id: str
    base_model: str
    tokenizer_id: str
    lora_rank: int | None

    @classmethod
    def new(
        cls, model_id: str, session_id: str, config: TrainingConfig, tokenizer_id: str
    ) -> ModelRecord:
        rank = config.lora.r if config.lora else None
        return cls(model_id, run_id_for(model_id), session_id, config.model, tokenizer_id, rank)

    def save(self, directory: Path) -> None:
        """Written atomically (temporary file, fsync, rename) under ``directory/models``."""
        text = json.dumps(asdict(self), sort_keys=True)
        write_text_atomic(directory / MODELS_DIR / f"{self.run_id}.json", text)

    def remove(self, directory: Path) -> None:
        (directory / MODELS_DIR / f"{self.run_id}.json").unlink(missing_ok=True)

    @classmethod
    def load_all(cls, directory: Path) -> list[ModelRecord]:
        """The open models recorded under ``directory``, by model id."""
        folder = directory / MODELS_DIR
        paths = sorted(folder.glob("*.json")) if folder.is_dir() else []
        models = [cls(**json.loads(path.read_text())) for path in paths]
        return sorted(models, key=lambda model: model.model_id)

    def info(self) -> dict[str, Any]:
        """The SDK's ``GetInfoResponse``."""
        return {
            "type": "get_info",
            "model_id": self.model_id,
            "model_name": self.base_model,
            "model_data": {
                "arch": "causal-lm",
                "model_name": self.base_model,
                "tokenizer_id": self.tokenizer_id,
            },
            "is_lora": self.lora_rank is not None,
            "lora_rank": self.lora_rank,
        }


def training_config(body: dict[str, Any]) -> TrainingConfig:
    """A ``CreateModelRequest`` as the run's config; InvalidArgument for what cannot be served."""
    base_model = get_str(body, "base_model")
    if not base_model:
        raise InvalidArgument("create_model: base_model is required (a model under --model-root)")
    optimizer = get_str(get_dict(body, "optimizer_config") or {}, "type", "adamw")
    if optimizer != "adamw":
        raise InvalidArgument(f"create_model: optimizer {optimizer!r}; this server runs adamw")
    lora = get_dict(body, "lora_config")
    seed = 0
    settings = None
    if lora is not None:
        rank = get_int(lora, "rank")
        if rank is None or rank < 1:
            raise InvalidArgument(f"create_model: lora_config.rank must be >= 1, got {rank!r}")
        roles = [role for role in LORA_ROLES if get_bool(lora, f"train_{role}", True)]
        if not roles:
            raise InvalidArgument("create_model: train at least one of attn, mlp, unembed")
        # Each role's layers are the model's own (GPT-2 names its attention c_attn, a mixture
        # of experts keeps its MLP as parameters): fit_lora_roles names them from the model.
        targets = tuple(ROLE_PREFIX + role for role in roles)
        settings = LoraSettings(r=rank, alpha=LORA_ALPHA, target_modules=targets)
        seed = get_int(lora, "seed", 0) or 0
    return TrainingConfig(
        model=base_model,
        lora=settings,
        learning_rate=1e-4,  # unused: every optim_step gives its own rate
        weight_decay=ADAM_DEFAULTS["weight_decay"],
        adam_beta1=ADAM_DEFAULTS["beta1"],
        adam_beta2=ADAM_DEFAULTS["beta2"],
        adam_epsilon=ADAM_DEFAULTS["eps"],
        lr_scheduler="constant",
        max_grad_norm=None,
        max_length=MAX_LENGTH,
        seed=seed,
    )


def fit_max_length(config: TrainingConfig, model_dir: Path) -> TrainingConfig:
    """``config`` with ``max_length`` at ``MAX_LENGTH``, or at the positions of the model in
    ``model_dir`` (resolved under the model root) where it has fewer: the engine refuses a
    max_length its model cannot hold, and a small model is still one the SDK can train."""
    positions = model_positions(model_config(model_dir) or {})
    return replace(config, max_length=min(MAX_LENGTH, positions or MAX_LENGTH))


def fit_lora_roles(config: TrainingConfig, model_dir: Path) -> TrainingConfig:
    """``config`` with its LoRA switches' roles named as the layers (and expert parameters) of
    the model in ``model_dir``, read from its config.json before anything is created;
    InvalidArgument naming the architecture for a switch that matches nothing there."""
    lora = config.lora
    if lora is None or not all(t.startswith(ROLE_PREFIX) for t in lora.target_modules):
        return config
    if model_config(model_dir) is None:
        return config  # no model there: opening it says so (NotFound), before any adapter
    roles = [target.removeprefix(ROLE_PREFIX) for target in lora.target_modules]
    found = lora_role_targets(model_dir, roles)
    chosen = replace(lora, target_modules=found.modules, target_parameters=found.parameters)
    return replace(config, lora=chosen)


def adam_settings(body: dict[str, Any]) -> dict[str, float]:
    """An ``OptimStepRequest``'s ``AdamParams`` as the update's settings (the operation table's
    ``OptimStepRequest`` fields): every field applies to that update, ``grad_clip_norm`` 0 being
    no clipping, as in Tinker. Values are checked where every transport's are (the table)."""
    if body.get("optimizer_params") is not None:
        raise InvalidArgument("optim_step: this server runs adamw; send AdamParams")
    params = get_dict(body, "adam_params") or get_dict(body, "optim_params")
    if params is None:
        raise InvalidArgument("optim_step: adam_params is required")
    settings = {"learning_rate": get_setting(params, "learning_rate", 1e-4)}
    for name, default in ADAM_DEFAULTS.items():
        settings[name] = get_setting(params, name, default)
    settings["max_grad_norm"] = get_setting(params, "grad_clip_norm", 0.0)
    return settings


def checkpoint_name(path: str, model_id: str, kind: str) -> str:
    """The checkpoint name in ``tinker://{model_id}/{kind}/{name}``, this model's only."""
    prefix = f"tinker://{model_id}/{kind}/"
    if not path.startswith(prefix) or len(path) == len(prefix):
        raise InvalidArgument(f"path {path!r}: this server loads {prefix}<name> paths only")
    return path[len(prefix) :]


def model_config(directory: Path) -> dict[str, Any] | None:
    """The model's ``config.json``, None where there is none or it is not a JSON object."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# Where a config.json keeps its positions: GPT-2 and its family call them n_positions.
POSITION_KEYS = ("max_position_embeddings", "n_positions")


def model_positions(config: dict[str, Any]) -> int | None:
    """A model config's positions (``max_position_embeddings``, or what its architecture calls
    them), None where it does not say."""
    positions = next((config[key] for key in POSITION_KEYS if key in config), None)
    return positions if isinstance(positions, int) and positions > 0 else None


def supported_models(model_root: Path | None) -> list[dict[str, Any]]:
    """The SDK's ``SupportedModel`` list: each model directory right under the model root
    (``base_model`` names it), causal LMs sampleable, with its positions as context length.
    Without a model root any local path may be opened, so none is listed."""
    if model_root is None or not model_root.is_dir():
        return []
    models = []
    for directory in sorted(p for p in model_root.iterdir() if (p / "config.json").is_file()):
        config = model_config(directory)
        if config is None:
            continue  # not a model this server could load either
        architectures = config.get("architectures") or []
        models.append(
            {
                "model_name": directory.name,
                "max_context_length": model_positions(config),
                "trainable": True,
                "sampleable": any(str(a).endswith("ForCausalLM") for a in architectures),
            }
        )
    return models
