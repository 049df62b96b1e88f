"""load_weights takes every layout from_pretrained takes: MoE experts, tied heads, prefixes.

transformers 5 keeps a Qwen3-MoE's experts fused in memory (``experts.gate_up_proj``) and one
tensor per expert on disk; exports, hub checkpoints and the tiny models hold the per-expert files.
A load converts them by the library's own mapping, checks names, shapes and dtypes of the result,
and only then copies: a refused load changes nothing. Expert adapters (``target_parameters``)
load, export and seed like any other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from architecture_models import ArchitectureModels
from fresh_state import fresh_digest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_weights import parameter_digest, params  # the same digests as the weights tests
from transformers import AutoModelForCausalLM

from trainwire.client import LoraSettings
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.weights import transfer as weights
from trainwire.server.errors import InvalidArgument
from trainwire.testing import tiny_text_examples

MODEL_FILE = "model.safetensors"
EXPERTS = LoraSettings(
    r=2,
    alpha=4,
    target_modules=("q_proj", "v_proj"),
    target_parameters=("gate_up_proj", "down_proj"),
)
EXPERT_KEY = "model.layers.0.mlp.experts.{}.gate_proj.weight"


@pytest.fixture(scope="module")
def architectures(model_root: Path) -> ArchitectureModels:
    return ArchitectureModels(model_root)


def trained(config, steps: int = 1) -> TrainingSession:
    session = TrainingSession(config)
    for _ in range(steps):
        session.forward_backward(tiny_text_examples(4)[:2])
        session.optim_step()
    return session


def rewritten(source: Path, directory: Path, change) -> Path:
    """A copy of the model directory ``source`` whose tensors ``change`` rewrites."""
    shutil.copytree(source, directory)
    tensors = load_file(directory / MODEL_FILE)
    change(tensors)
    save_file(tensors, directory / MODEL_FILE, metadata={"format": "pt"})
    return directory


def test_native_names_strip_every_nested_peft_wrapper() -> None:
    live = "base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj"
    assert weights.native_name(live) == "model.layers.0.mlp.experts.gate_up_proj"
    assert weights.native_name("base_model.model.lm_head.base_layer.weight") == "lm_head.weight"
    assert weights.native_name("base_model.model.model.layers.0.mlp.experts.lora_A.weight") is None


def test_a_full_moe_export_loads_back_though_its_files_hold_one_tensor_per_expert(
    architectures, tmp_path
) -> None:
    config = architectures.config("qwen3-moe")
    session = trained(config)
    session.export_weights(tmp_path / "export")
    with safe_open(tmp_path / "export" / MODEL_FILE, "pt") as files:
        assert EXPERT_KEY.format(3) in set(files.keys())
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["experts_implementation"] == "eager"  # what the session ran, reloaded

    fresh = TrainingSession(config)
    fresh.load_weights(tmp_path / "export")
    assert parameter_digest(params(fresh)) == parameter_digest(params(session))


def test_a_full_moe_model_seeds_lora_adapters_on_its_experts(architectures, tmp_path) -> None:
    full = trained(architectures.config("qwen3-moe"))
    full.export_weights(tmp_path / "full")

    session = TrainingSession(architectures.config("qwen3-moe", lora=EXPERTS))
    adapters = params(session, adapters=True)
    assert any(".experts." in name for name in adapters)  # the experts carry adapters
    base_fingerprint = session.base_fingerprint
    session.load_weights(tmp_path / "full")

    assert parameter_digest(params(session, adapters=True)) == parameter_digest(adapters)
    trained_weights = params(full)
    for name, parameter in params(session, adapters=False).items():
        assert torch.equal(parameter, trained_weights[weights.native_name(name)]), name
    assert session.base_fingerprint != base_fingerprint
    session.forward_backward(tiny_text_examples(4)[:2])


def fused(tensors: dict[str, torch.Tensor]) -> None:
    """The in-memory layout: one gate_up_proj and one down_proj tensor for all experts."""
    prefix = "model.layers.0.mlp.experts"
    count = sum(1 for key in tensors if key.endswith(".gate_proj.weight") and ".experts." in key)
    take = [
        {kind: tensors.pop(f"{prefix}.{i}.{kind}_proj.weight") for kind in ("gate", "up", "down")}
        for i in range(count)
    ]
    tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in take])
    tensors[f"{prefix}.down_proj"] = torch.stack([e["down"] for e in take])


def without_prefix(tensors: dict[str, torch.Tensor]) -> None:
    """A base model's checkpoint: no ``model.`` before the body's names."""
    for key in [k for k in tensors if k.startswith("model.")]:
        tensors[key.removeprefix("model.")] = tensors.pop(key)


def with_tied_head(tensors: dict[str, torch.Tensor]) -> None:
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()


@pytest.mark.parametrize(
    ("name", "change"),
    [("qwen3-moe", fused), ("qwen3-moe", without_prefix), ("qwen2.5", with_tied_head)],
    ids=["fused-experts", "no-prefix", "tied-head-saved"],
)
def test_every_layout_from_pretrained_takes_loads_here_too(
    architectures, tmp_path, name, change
) -> None:
    source = rewritten(architectures.path(name), tmp_path / "source", change)
    expected = dict(AutoModelForCausalLM.from_pretrained(source).named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(architectures.path(name)).named_parameters())
    assert parameter_digest(expected) == parameter_digest(
        base
    )  # the same weights in another layout

    session = trained(architectures.config(name))
    session.load_weights(source)
    assert parameter_digest(params(session)) == parameter_digest(expected)


def fused_as_well(tensors: dict[str, torch.Tensor]) -> None:
    per_expert = dict(tensors)
    fused(tensors)
    tensors.update(per_expert)


def drop_expert(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[EXPERT_KEY.format(2)]


def shrink_expert(tensors: dict[str, torch.Tensor]) -> None:
    tensors[EXPERT_KEY.format(1)] = tensors[EXPERT_KEY.format(1)][:-1]


def bf16_expert(tensors: dict[str, torch.Tensor]) -> None:
    tensors[EXPERT_KEY.format(1)] = tensors[EXPERT_KEY.format(1)].bfloat16()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (drop_expert, r"gate_up_proj"),
        (shrink_expert, r"gate_up_proj"),
        (bf16_expert, r"experts\.1\.gate_proj\.weight: dtype torch\.bfloat16, model has torch\.f"),
        (
            fused_as_well,
            r"experts\.down_proj: given twice, as model\.layers\.0\.mlp\.experts\.down_proj and "
            r"as model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight and the tensors merged",
        ),
    ],
    ids=["missing-expert", "expert-shape", "expert-dtype", "both-layouts"],
)
def test_moe_weights_that_do_not_fit_are_refused_before_any_live_tensor_changes(
    architectures, tmp_path, damage, message
) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] + 1
        damage(tensors)

    source = rewritten(architectures.path("qwen3-moe"), tmp_path / "damaged", change)
    for lora in (None, EXPERTS):
        session = TrainingSession(architectures.config("qwen3-moe", lora=lora))
        digest = fresh_digest(session)
        with pytest.raises(
            InvalidArgument, match=rf"the weights do not fit this model: .*{message}"
        ):
            session.load_weights(source)
        assert fresh_digest(session) == digest


def test_expert_adapters_train_and_an_adapter_export_loads_only_with_the_same_targets(
    architectures, tmp_path
) -> None:
    lora = LoraSettings(r=2, alpha=4, target_modules=(), target_parameters=("gate_up_proj",))
    config = architectures.config("gpt-oss", lora=lora)
    session = TrainingSession(config)
    before = params(session, adapters=True)
    assert before and all(".experts." in name for name in before)
    session.forward_backward(tiny_text_examples(4)[:2])
    session.optim_step()
    assert parameter_digest(params(session, adapters=True)) != parameter_digest(before)
    session.export_weights(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / weights.ADAPTER_CONFIG_FILE).read_text())
    assert saved["target_parameters"] == ["gate_up_proj"]
    assert weights.read_export_record(tmp_path / "adapter")["config"]["lora"]["target_parameters"]

    again = TrainingSession(config)
    again.load_weights(tmp_path / "adapter")
    assert parameter_digest(params(again)) == parameter_digest(params(session))

    both = lora.to_dict() | {"target_parameters": ["gate_up_proj", "down_proj"]}
    other = TrainingSession(architectures.config("gpt-oss", lora=LoraSettings(**both)))
    digest = fresh_digest(other)
    with pytest.raises(InvalidArgument, match=r"target_parameters: saved \['gate_up_proj'\], now"):
        other.load_weights(tmp_path / "adapter")
    assert fresh_digest(other) == digest
