"""Tiny random-init models of the architectures users bring, built offline from their configs.

Why: the suite's own tiny llama and bert prove the engine, not that it holds on the layouts people
train (fused or per-expert MoE weights, tied embeddings, GPT-2's ``Conv1D`` layers, Gemma's
soft-capped logits). Each entry of :data:`ARCHITECTURES` names a transformers config class and the
few settings that make it minuscule; :func:`make_tiny_architecture` writes that model with the
test tokenizer of :mod:`trainwire.tiny_models`, so ``from_pretrained`` loads it from the directory.

A new architecture is one line in :data:`ARCHITECTURES`. The same name and seed give the same
files on every run; the caller's torch RNG is untouched (see :func:`make_tiny_model`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwire.tiny_models import (
    ATTN_IMPLEMENTATION,
    CONFIG_FILE,
    MAX_POSITIONS,
    _init_model,
    _pretrained_tokenizer,
    _save_model,
    _validate_model_args,
)

# The shape most decoders share: one layer, 16 wide, two query heads over one key/value head.
DECODER = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
    "max_position_embeddings": MAX_POSITIONS,
}
# A mixture of experts: four experts, two per token, each as wide as the model.
EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
ENCODER = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": MAX_POSITIONS,
}


@dataclass(frozen=True)
class TinyArchitecture:
    """One architecture of the matrix.

    Attributes:
        name: how tests and users name it (``qwen3-moe``).
        config_class: the transformers config class that builds it (``Qwen3MoeConfig``).
        task: ``causal-lm`` or ``sequence-classification``.
        settings: the config's keyword arguments beyond the vocabulary and special tokens.
    """

    name: str
    config_class: str
    task: str = "causal-lm"
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def tokenizer(self) -> str:
        """The test tokenizer it uses: byte-level BPE for decoders, WordPiece for encoders."""
        return "llama" if self.task == "causal-lm" else "bert"


def _line(
    name: str, config_class: str, task: str = "causal-lm", **settings: Any
) -> TinyArchitecture:
    return TinyArchitecture(name, config_class, task, settings)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Llama 3.2 and the small Qwen 2.5 tie the output head to the embeddings, as Gemma does.
LLAMA3 = {**DECODER, "tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}
GEMMA = {**DECODER, "sliding_window": 8, "query_pre_attn_scalar": 8}
GPT2 = {"n_embd": 16, "n_layer": 1, "n_head": 2, "n_inner": 32, "n_positions": MAX_POSITIONS}
GPT_OSS = {
    **DECODER,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    # YaRN stretched from 64 positions to the 256 the tiny models hold.
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": MAX_POSITIONS / 64,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}
PHI3 = {**DECODER, "original_max_position_embeddings": MAX_POSITIONS}
# RoBERTa counts positions from after the pad id, so it holds two more.
ROBERTA = {**ENCODER, "max_position_embeddings": MAX_POSITIONS + 2}
CLASSIFIER = "sequence-classification"
EXPERTS_IMPLEMENTATION = "eager"  # like eager attention: the same bits on every CPU run

ARCHITECTURES: dict[str, TinyArchitecture] = {
    arch.name: arch
    for arch in (
        _line("qwen2", "Qwen2Config", **DECODER, tie_word_embeddings=False),
        _line("qwen2.5", "Qwen2Config", **DECODER, tie_word_embeddings=True),
        _line("qwen3", "Qwen3Config", **DECODER, tie_word_embeddings=True),
        _line("qwen3-moe", "Qwen3MoeConfig", **DECODER, **EXPERTS, num_experts=4),
        _line("llama3", "LlamaConfig", **LLAMA3),
        _line("mistral", "MistralConfig", **DECODER, sliding_window=8),
        _line("gemma2", "Gemma2Config", **GEMMA),
        _line("gemma3", "Gemma3TextConfig", **GEMMA),
        _line("phi3", "Phi3Config", **PHI3),
        _line("gpt2", "GPT2Config", **GPT2),
        _line("gpt-oss", "GptOssConfig", **GPT_OSS),
        _line("olmo2", "Olmo2Config", **DECODER),
        _line("bert", "BertConfig", CLASSIFIER, **ENCODER),
        _line("roberta", "RobertaConfig", CLASSIFIER, **ROBERTA),
    )
}


def make_tiny_architecture(
    directory: str | Path, name: str, *, labels: Sequence[str] = (), seed: int = 0
) -> Path:
    """Write the tiny ``name`` model of :data:`ARCHITECTURES` and its tokenizer into ``directory``.

    Args:
        directory: where to write; created if needed.
        name: a key of :data:`ARCHITECTURES`.
        labels: the class names of a ``sequence-classification`` architecture (at least 2); empty
            for a causal one.
        seed: initializes the weights; the caller's global torch RNG is not touched.

    Returns:
        ``directory`` as a Path, loadable with ``AutoTokenizer`` and the architecture's task's
        ``AutoModelFor...``.

    Raises:
        ValueError: an unknown name or bad labels or seed, before anything is written.
    """
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(
            f"make_tiny_architecture: unknown architecture {name!r}: use one of "
            + ", ".join(ARCHITECTURES)
        )
    labels = _validate_model_args(arch.task, arch.tokenizer, labels, seed, None)
    tokenizer = _pretrained_tokenizer(arch.tokenizer)
    config = _config(arch, tokenizer, labels)
    model = _init_model(config, arch.task, seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _save_model(model, out, None)
    if hasattr(config, "_experts_implementation"):
        _record_experts_implementation(out / CONFIG_FILE)
    tokenizer.save_pretrained(out)
    return out


def _record_experts_implementation(config_path: Path) -> None:
    """transformers picks a grouped kernel for experts unless config.json names one (and
    ``save_pretrained`` leaves it out), as it does for attention: written here, a plain
    ``from_pretrained`` runs the eager experts too."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["experts_implementation"] = EXPERTS_IMPLEMENTATION
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _config(arch: TinyArchitecture, tokenizer: Any, labels: tuple[str, ...]) -> Any:
    import transformers

    tokens: dict[str, Any] = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id}
    if arch.task == "causal-lm":
        tokens.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    else:
        tokens.update(
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: index for index, label in enumerate(labels)},
            problem_type="single_label_classification",
        )
    config_class = getattr(transformers, arch.config_class)
    return config_class(attn_implementation=ATTN_IMPLEMENTATION, **arch.settings, **tokens)
