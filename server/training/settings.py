"""The settings a run is bound to: the free ones (how it trains) and the constructor's (what model).

Both are plain, fixed-order dicts of JSON types, so a checkpoint records them as they are and a
resume compares them key by key, naming every difference.
"""

from __future__ import annotations

from typing import Any

from trainwire.client.config import TrainingConfig

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


def run_settings(config: TrainingConfig, *, accelerator: str, precision: str) -> dict[str, Any]:
    """The run's free settings, in a fixed order, JSON types only.

    Where it trains (``accelerator``, one device) and at what Lightning ``precision`` come first,
    then the config's free keys (``FREE_CONFIG_KEYS``). A JSON round trip returns an equal dict.
    """
    settings: dict[str, Any] = {"accelerator": accelerator, "devices": 1, "precision": precision}
    for key in FREE_CONFIG_KEYS:
        settings[key] = _json_value(getattr(config, key))
    return settings


def constructor_settings(config: TrainingConfig) -> dict[str, Any]:
    """What shapes the model: the base model, task, labels and the LoRA adapter, if any.

    A full-weights run has no ``lora.*`` keys, so comparing it with a LoRA run reports them
    ``absent`` on one side.
    """
    settings: dict[str, Any] = {
        "model": config.model,
        "task": config.task,
        "labels": list(config.labels),
        "lora": config.lora is not None,
    }
    if config.lora is not None:
        settings["lora.r"] = config.lora.r
        settings["lora.alpha"] = config.lora.alpha
        settings["lora.dropout"] = config.lora.dropout
        settings["lora.target_modules"] = list(config.lora.target_modules)
        settings["lora.use_dora"] = config.lora.use_dora
    return settings


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str, list)):
        return value
    raise TypeError(f"{type(value).__name__} is not a JSON value")
