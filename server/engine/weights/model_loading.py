"""Loading a session's model and tokenizer from a local directory, and wrapping it in LoRA.

Model paths resolve under the session's model root, and nothing outside it is read. Loading runs
through the real ``from_pretrained`` path, offline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainwire.contract.config import LoraSettings, TrainingConfig, is_int
from trainwire.server.errors import InvalidArgument, NotFound
from trainwire.server.paths import resolve_under

MODEL_CONFIG_FILE = "config.json"


def resolve_model_dir(config: TrainingConfig, model_root: Path | None) -> Path:
    path = resolve_under(model_root, config.model, "model")
    try:
        found = (path / MODEL_CONFIG_FILE).is_file()
    except OSError as error:  # a name too long for the filesystem, say
        raise InvalidArgument(f"model {config.model[:100]!r}: {error.strerror}") from None
    if not found:
        where = "" if model_root is None else f" under the model root ({models_under(model_root)})"
        raise NotFound(
            f"model {config.model!r}: no {MODEL_CONFIG_FILE} there; name a model directory{where}"
        )
    return path


def models_under(model_root: Path, limit: int = 20) -> str:
    """What a user may name instead: the model directories right under the root, by name."""
    try:
        names = sorted(p.name for p in model_root.iterdir() if (p / MODEL_CONFIG_FILE).is_file())
    except OSError:
        names = []
    if not names:
        return "it holds no model directory"
    shown = ", ".join(names[:limit])
    return f"it holds {shown}" + (f" and {len(names) - limit} more" if len(names) > limit else "")


def model_positions(model_dir: Path) -> int | None:
    """The positions the model in ``model_dir`` has (its config's ``max_position_embeddings``,
    under whatever name its architecture keeps it), read before any weights load; None when it
    has none or its config does not load (then loading the model reports why)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError):
        return None
    positions = getattr(config, "max_position_embeddings", None)
    return positions if is_int(positions) else None


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_model(
    config: TrainingConfig, model_dir: Path, dtype: torch.dtype, tokenizer
) -> torch.nn.Module:
    """The task's Auto model, in ``dtype`` on the CPU (the caller moves it to its device)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    if config.task == "causal-lm":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir,
            dtype=dtype,
            local_files_only=True,
            num_labels=len(config.labels),
            id2label=dict(enumerate(config.labels)),
            label2id={label: i for i, label in enumerate(config.labels)},
        )
        if model.config.pad_token_id is None:
            # Decoder classifiers find each sequence's last token through the pad id.
            model.config.pad_token_id = tokenizer.pad_token_id
    model.config.use_cache = False
    return model


def peft_target_modules(lora: LoraSettings) -> str | list[str]:
    return "all-linear" if lora.target_modules == ("all-linear",) else list(lora.target_modules)


def apply_lora(model: torch.nn.Module, config: TrainingConfig) -> torch.nn.Module:
    """Wrap ``model`` in one trainable LoRA adapter (draws its initialization from the RNG)."""
    from peft import LoraConfig, TaskType, get_peft_model

    lora = config.lora
    assert lora is not None
    check_lora_rank(model, lora.r)
    task_type = TaskType.CAUSAL_LM if config.task == "causal-lm" else TaskType.SEQ_CLS
    try:
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=peft_target_modules(lora),
            # None, not [], when unset: the adapter_config.json of every adapter stays as it was.
            target_parameters=list(lora.target_parameters) or None,
            use_dora=lora.use_dora,
            task_type=task_type,
        )
        return get_peft_model(model, peft_config)
    except ValueError as error:
        raise InvalidArgument(f"lora: {error}") from None


def check_lora_rank(model: torch.nn.Module, rank: int) -> None:
    """InvalidArgument, before any adapter is made, for a rank no weight of ``model`` can use.

    An adapter's update to a ``[out, in]`` weight has rank at most ``min(out, in)``; past the
    largest such bound of any of the model's weights, a rank only adds parameters and moments
    that change nothing (a typo's rank of 100000 on a small model took a gigabyte), so it is
    refused with the bound."""
    usable = max(
        (min(p.shape[-2], p.shape[-1]) for p in model.parameters() if p.ndim >= 2), default=0
    )
    if rank > usable:
        raise InvalidArgument(
            f"lora: rank {rank} is past what this model's weights can use (an update to a "
            f"weight has rank at most its smaller dimension; the largest here is {usable}): "
            f"choose a rank from 1 to {usable}"
        )


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant checkpointing: frozen embeddings do not cut the adapters' gradients."""
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed it (the old name warns); older releases only have the old name.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_session_model(
    config: TrainingConfig,
    model_dir: Path,
    dtype: torch.dtype,
    tokenizer,
    device: torch.device,
    *,
    loaded: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """The model a session trains: loaded, wrapped in LoRA and checkpointed as the config asks,
    on ``device``. Run it under the session's RNG: LoRA initialization draws from it.

    ``loaded`` is a model to wrap instead of loading one (a ``SharedBase`` instance, whose
    loading drew nothing from the RNG, so the adapter draws what it would draw here)."""
    model = load_model(config, model_dir, dtype, tokenizer) if loaded is None else loaded
    if config.lora is not None:
        model = apply_lora(model, config)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model.to(device)
