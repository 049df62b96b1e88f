"""The settings a run is bound to: the free ones (how it trains) and the constructor's (what model).

Both are plain, fixed-order dicts of JSON types, so a checkpoint records them as they are and a
resume compares them key by key, naming every difference.
"""

from __future__ import annotations

from typing import Any

from trainwire.contract.config import TrainingConfig

# The config keys a run may choose freely, in the order they are recorded and reported.
# Accumulation, clipping and the epoch budget come first: they are what a resume most often
# changes by mistake.
FREE_CONFIG_KEYS = (
    "gradient_accumulation_steps",
    "max_grad_norm",
    "num_epochs",
    "batch_size",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_length",
    "truncation",
    "shuffle",
    "group_by_length",
    "gradient_checkpointing",
    "eval_strategy",
    "eval_steps",
    "metric_for_best",
    "greater_is_better",
    "early_stopping",
    "early_stopping_patience",
    "num_workers",
)


def run_settings(cfg: TrainingConfig, *, accelerator: str, precision: str) -> dict[str, Any]:
    """The run's free settings, in a fixed order, JSON types only.

    Where it trains (``accelerator``, one device) and at what Lightning ``precision``
    (``effective_precision``) come first, then the config's free keys (``FREE_CONFIG_KEYS``).
    A checkpoint records them, so a resume under other settings is refused
    (``refuse_a_resume_under_other_settings``); a JSON round trip returns an equal dict.
    """
    settings: dict[str, Any] = {"accelerator": accelerator, "devices": 1, "precision": precision}
    for key in FREE_CONFIG_KEYS:
        settings[key] = _json_value(getattr(cfg, key))
    return settings


def constructor_settings(cfg: TrainingConfig) -> dict[str, Any]:
    """What shapes the model, beside ``run_settings``: the base model, task, labels and the
    LoRA adapter (rank, alpha, dropout, targets, DoRA, target parameters), if any.

    A checkpoint's weights fit only this model (``refuse_other_constructor_settings``). A
    full-weights run has no ``lora.*`` keys, so comparing it with a LoRA run reports them
    ``absent`` on one side.
    """
    settings: dict[str, Any] = {
        "model": cfg.model,
        "task": cfg.task,
        "labels": list(cfg.labels),
        "lora": cfg.lora is not None,
    }
    if cfg.lora is not None:
        settings["lora.r"] = cfg.lora.r
        settings["lora.alpha"] = cfg.lora.alpha
        settings["lora.dropout"] = cfg.lora.dropout
        settings["lora.target_modules"] = list(cfg.lora.target_modules)
        settings["lora.use_dora"] = cfg.lora.use_dora
        # Only when set, as in the config's JSON: checkpoints from before it compare equal.
        if cfg.lora.target_parameters:
            settings["lora.target_parameters"] = list(cfg.lora.target_parameters)
    return settings


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str, list)):
        return value
    raise TypeError(f"{type(value).__name__} is not a JSON value")
