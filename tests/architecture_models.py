"""The tiny architecture matrix the tests share: models built on first use, configs for them.

Each model is written once per test session under the shared ``model_root`` (as
``arch-<name>``) and must be treated as read-only, like the other tiny models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainwire.client import LoraSettings, TrainingConfig
from trainwire.testing import (
    ARCHITECTURES,
    SENTIMENT_LABELS,
    make_tiny_architecture,
    tiny_sentiment_examples,
    tiny_text_examples,
)

# Layouts the fast suite covers: fused experts converted per expert on disk (qwen3-moe), experts
# adapted only as parameters (gpt-oss), Conv1D layers and a tied head (gpt2), soft-capped logits
# and sliding attention (gemma3), an encoder whose positions start after the pad id (roberta).
# Every other architecture runs the same checks in the slow suite.
FAST = ("qwen3-moe", "gpt-oss", "gpt2", "gemma3", "roberta")
CAUSAL = tuple(name for name, arch in ARCHITECTURES.items() if arch.task == "causal-lm")
SETTINGS: dict[str, Any] = {
    "batch_size": 2,
    "max_length": 64,
    "learning_rate": 1e-2,  # the minuscule weights move visibly in one update
    "lr_scheduler": "constant",
}


class ArchitectureModels:
    """``path(name)``: the tiny model of architecture ``name``, written on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        directory = self.root / f"arch-{name}"
        if not (directory / "config.json").is_file():
            labels = SENTIMENT_LABELS if not is_causal(name) else ()
            make_tiny_architecture(directory, name, labels=labels)
        return directory

    def config(
        self, name: str, lora: LoraSettings | None = None, **overrides: Any
    ) -> TrainingConfig:
        arch = ARCHITECTURES[name]
        labels = SENTIMENT_LABELS if not is_causal(name) else ()
        values = {**SETTINGS, "task": arch.task, "labels": labels, "lora": lora, **overrides}
        return TrainingConfig(model=str(self.path(name)), **values)


def is_causal(name: str) -> bool:
    return ARCHITECTURES[name].task == "causal-lm"


def examples(name: str, count: int = 4) -> list[Any]:
    return tiny_text_examples(count) if is_causal(name) else tiny_sentiment_examples(count)


def matrix(slow_mark: Any) -> list[Any]:
    """Every architecture's name, the ones outside ``FAST`` carrying ``slow_mark``."""
    import pytest

    return [pytest.param(name, marks=() if name in FAST else slow_mark) for name in ARCHITECTURES]
