"""The tiny architecture matrix's models, and quiet tiny-model writing.

What the matrix's models promise (the training checks are in test_architectures.py): each is
built offline from its config class, loads with the Auto classes, repeats byte for byte, and a
mixture of experts is on disk as transformers writes one (a tensor per expert) while it trains
fused in memory. Writing a tiny model shows no progress bar, and hides nothing else.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from trainwire.testing import ARCHITECTURES, make_tiny_architecture, make_tiny_model


def file_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def test_the_same_architecture_and_seed_write_byte_identical_files(tmp_path: Path) -> None:
    first = make_tiny_architecture(tmp_path / "a", "qwen3-moe")
    second = make_tiny_architecture(tmp_path / "b", "qwen3-moe")
    assert file_digests(first) == file_digests(second)
    other_seed = make_tiny_architecture(tmp_path / "c", "qwen3-moe", seed=1)
    assert file_digests(other_seed)["model.safetensors"] != file_digests(first)["model.safetensors"]


def test_the_callers_torch_rng_is_untouched(tmp_path: Path) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    make_tiny_architecture(tmp_path / "gemma3", "gemma3", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_moe_experts_are_one_tensor_each_on_disk_and_fused_in_memory(tmp_path: Path) -> None:
    directory = make_tiny_architecture(tmp_path / "moe", "qwen3-moe")
    with safe_open(directory / "model.safetensors", "pt") as files:
        on_disk = set(files.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in on_disk
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    in_memory = dict(model.named_parameters())
    assert in_memory["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    assert "model.layers.0.mlp.experts.gate_up_proj" not in on_disk
    assert model.config._experts_implementation == "eager"


def test_every_architecture_is_named_with_its_config_class() -> None:
    import transformers

    for name, arch in ARCHITECTURES.items():
        assert hasattr(transformers, arch.config_class), name
        assert arch.task in ("causal-lm", "sequence-classification"), name


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"name": "llama4"}, r"unknown architecture 'llama4': use one of qwen2, "),
        ({"name": "bert"}, r"sequence-classification needs at least 2 labels"),
        ({"name": "gpt2", "labels": ("a", "b")}, r"labels are only for sequence-classification"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, arguments, message
) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_architecture(tmp_path / "model", **arguments)
    assert not (tmp_path / "model").exists()


def test_writing_a_tiny_model_shows_no_progress_bar_and_keeps_warnings(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()
    verbosity = transformers_logging.get_verbosity()
    try:
        make_tiny_model(tmp_path / "llama", shards=2)
        make_tiny_architecture(tmp_path / "gpt2", "gpt2")
        # The caller's choice stands: bars back on.
        assert transformers_logging.is_progress_bar_enabled()
    finally:
        if not was_enabled:
            transformers_logging.disable_progress_bar()
    assert "Writing model shards" not in capfd.readouterr().err
    # Warnings still reach their handlers.
    assert transformers_logging.get_verbosity() == verbosity
    with caplog.at_level(logging.WARNING):
        transformers_logging.get_logger("transformers.modeling_utils").warning("a real warning")
    assert "a real warning" in caplog.text
