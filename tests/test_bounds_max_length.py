"""The Tinker front asks for a max_length of 32,768 tokens, or the model's positions where it has
fewer, so that a small model is still one the SDK can train once the engine refuses a max_length
its model cannot hold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainwire.server.tinker.model import MAX_LENGTH, fit_max_length, training_config

POSITIONS = 256  # the tiny llama's max_position_embeddings


def model_with_positions(source: Path, directory: Path, positions: int | None) -> Path:
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("max_position_embeddings")
    if positions is not None:
        config["max_position_embeddings"] = positions
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_tinker_front_asks_for_at_most_the_models_positions(tiny_llama, tmp_path):
    config = training_config({"base_model": "llama"})
    assert config.max_length == MAX_LENGTH == 32768
    assert fit_max_length(config, tiny_llama).max_length == POSITIONS
    large = model_with_positions(tiny_llama, tmp_path / "large", 131072)
    assert fit_max_length(config, large).max_length == MAX_LENGTH
    unknown = model_with_positions(tiny_llama, tmp_path / "unknown", None)
    assert fit_max_length(config, unknown).max_length == MAX_LENGTH
    assert fit_max_length(config, tmp_path / "missing").max_length == MAX_LENGTH
