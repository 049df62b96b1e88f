"""The names a user types into a config: trainwire's keys, what each means, the Hugging Face
names that mean the same thing, and the nearest key to a typo.

A researcher arrives with ``TrainingArguments`` (and PEFT ``LoraConfig``) names in their fingers;
``num_train_epochs`` means exactly ``num_epochs`` here, so it is accepted and stored under
trainwire's name (the manifest, the fingerprint and every checkpoint see one spelling). A name
that means something else (``bf16``: a precision, not a flag) is not an alias: it is refused
with the nearest key, as any other unknown name is.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

# Hugging Face TrainingArguments (and TRL's SFTConfig) names -> trainwire's key.
CONFIG_ALIASES: Mapping[str, str] = {
    "num_train_epochs": "num_epochs",
    "per_device_train_batch_size": "batch_size",
    "lr_scheduler_type": "lr_scheduler",
    "dataloader_num_workers": "num_workers",
    "evaluation_strategy": "eval_strategy",
    "metric_for_best_model": "metric_for_best",
    "max_seq_length": "max_length",
}

# PEFT LoraConfig names -> trainwire's ``lora`` key.
LORA_ALIASES: Mapping[str, str] = {
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
}

CONFIG_MEANINGS: Mapping[str, str] = {
    "model": "required: a model directory, resolved under the server's (or train's) model root",
    "task": "causal-lm or sequence-classification",
    "labels": "the class names of a classification task, in label-id order",
    "lora": "one LoRA adapter (r, alpha, dropout, target_modules, use_dora), or null: full weights",
    "learning_rate": "AdamW's peak learning rate",
    "weight_decay": "AdamW's decoupled weight decay (biases and norms never decay)",
    "adam_beta1": "AdamW's first-moment decay",
    "adam_beta2": "AdamW's second-moment decay",
    "adam_epsilon": "AdamW's denominator epsilon",
    "lr_scheduler": "linear, constant or cosine, after warmup_steps of linear warmup",
    "warmup_steps": "optimizer updates of linear warmup",
    "max_grad_norm": "clip the global gradient norm to this; null: no clipping",
    "batch_size": "examples per microbatch",
    "gradient_accumulation_steps": "microbatches per optimizer update",
    "num_epochs": "passes over the training examples",
    "max_length": "the longest example in tokens; longer ones are refused unless truncation",
    "shuffle": "shuffle the examples each epoch (seeded: the same order on every machine)",
    "group_by_length": "batch examples of similar length together (seeded)",
    "seed": "seeds the plan's order and the session's random state",
    "precision": "fp32, or bf16 on a CUDA device with native bf16",
    "gradient_checkpointing": "recompute activations in the backward to save memory",
    "eval_strategy": "no, epoch or steps: when to evaluate",
    "eval_steps": "updates between evaluations when eval_strategy is steps",
    "metric_for_best": "eval_loss or eval_accuracy: what selects the best checkpoint",
    "greater_is_better": "true, false, or null: as the metric implies",
    "early_stopping": "stop after early_stopping_patience evaluations without gain",
    "early_stopping_patience": "evaluations without gain before stopping",
    "truncation": "cut over-long examples to max_length instead of refusing them",
    "num_workers": "must be 0: data is tokenized in the session's own thread",
}


def with_trainwire_names(
    data: Mapping[str, Any], aliases: Mapping[str, str], *, prefix: str = ""
) -> dict[str, Any]:
    """``data`` with every alias renamed to trainwire's key; an alias given beside its key is a
    ``ValueError`` naming both (which of the two would win is a guess trainwire does not make)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = aliases.get(key, key)
        if name in out or (name != key and name in data):
            raise ValueError(f"{prefix}{key} and {prefix}{name} are the same setting: give one")
        out[name] = value
    return out


def unknown_keys_message(
    unknown: list[str], known: list[str], aliases: Mapping[str, str], *, what: str, prefix: str = ""
) -> str:
    """``unknown config key(s): learning_rat (did you mean learning_rate?)`` and where the list of
    every key is printed."""
    candidates = [*known, *aliases]
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        hint = f" (did you mean {prefix}{aliases.get(close[0], close[0])}?)" if close else ""
        named.append(f"{prefix}{key}{hint}")
    return (
        f"unknown {what} key(s): {', '.join(named)}; "
        "`trainwire plan --print-config` lists every key with its default and meaning"
    )


def describe_config_keys(defaults: Mapping[str, Any], lora_defaults: Mapping[str, Any]) -> str:
    """Every config key as YAML, its default as the value and its meaning as a comment: a file a
    user can save, set ``model`` in, and pass to ``trainwire plan --config``."""
    import yaml

    def flow(value: Any) -> str:
        text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1000)
        return text.strip().removesuffix("\n...")

    renames = ", ".join(f"{alias} -> {key}" for alias, key in CONFIG_ALIASES.items())
    lines = [
        "# trainwire's training config: every key, its default and its meaning.",
        f"# Hugging Face names accepted for the same settings: {renames}.",
    ]
    for key, meaning in CONFIG_MEANINGS.items():
        lines.append(f"{key}: {flow(defaults.get(key))}  # {meaning}")
        if key == "lora":
            lines.append(f"#   for example: lora: {flow(dict(lora_defaults))}")
    return "\n".join(lines) + "\n"
