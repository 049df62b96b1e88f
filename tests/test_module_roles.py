"""The Tinker front's LoRA switches adapt what they name, on every architecture.

``train_attn``, ``train_mlp`` and ``train_unembed`` name roles; the layers behind them are the
loaded model's own (GPT-2's ``c_attn``, Phi-3's fused ``qkv_proj``, experts kept as parameters).
Each switch is checked against the model's module tree read independently here: attention weights
live under ``self_attn``/``attn``, MLP weights under ``mlp`` (routers stay frozen), the
unembedding is ``lm_head``. A switch that matches nothing is refused, naming the architecture,
before anything is created.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
from architecture_models import CAUSAL, ArchitectureModels
from tinker_loops import KEY, tinker_server
from transformers import MambaConfig

from trainwire.server.engine.weights import transfer as weights
from trainwire.server.engine.weights.model_loading import apply_lora, load_model, load_tokenizer
from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker.model import fit_lora_roles, fit_max_length, training_config

ROLE_NAMES = {
    "attn": re.compile(r"\.(self_attn|attn)\."),
    "mlp": re.compile(r"\.mlp\.(?!gate\.|router\.)"),
    "unembed": re.compile(r"^lm_head\."),
}
SWITCHES = {
    "every role": {},
    "attention": {"train_mlp": False, "train_unembed": False},
    "mlp": {"train_attn": False, "train_unembed": False},
    "unembedding": {"train_attn": False, "train_mlp": False},
}


@pytest.fixture(scope="module")
def architectures(model_root: Path) -> ArchitectureModels:
    return ArchitectureModels(model_root)


def tinker_config(directory: Path, switches: dict[str, bool]):
    """What create_model opens for ``lora_config`` switches on the model in ``directory``."""
    body = {"base_model": directory.name, "lora_config": {"rank": 2, **switches}}
    fitted = fit_lora_roles(fit_max_length(training_config(body), directory), directory)
    return replace(fitted, model=str(directory))


def role_weights(model: torch.nn.Module, roles: list[str]) -> set[str]:
    """The matrices (2-d weights, 3-d expert stacks) under the roles' blocks, by name alone."""
    return {
        name
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if (name.endswith(".weight") and parameter.ndim == 2) or parameter.ndim == 3
        if any(ROLE_NAMES[role].search(name) for role in roles)
    }


def adapted_weights(model: torch.nn.Module) -> set[str]:
    """The base weights PEFT put an adapter on: a layer's weight, or a wrapped parameter."""
    adapted = set()
    for name, module in model.named_modules():
        if len(getattr(module, "lora_A", {})) == 0:
            continue
        parameter = getattr(module, "parameter_name", None) or "weight"
        adapted.add(weights.native_name(f"{name}.{parameter}"))
    return adapted


@pytest.mark.parametrize("name", CAUSAL)
def test_each_lora_switch_adapts_exactly_the_layers_of_its_role(architectures, name) -> None:
    directory = architectures.path(name)
    tokenizer = load_tokenizer(directory)
    for label, switches in SWITCHES.items():
        config = tinker_config(directory, switches)
        roles = [role for role in ROLE_NAMES if switches.get(f"train_{role}", True)]
        base = load_model(config, directory, torch.float32, tokenizer)
        expected = role_weights(base, roles)
        assert expected, f"{name} {label}: no weights of {roles}"
        assert adapted_weights(apply_lora(base, config)) == expected, f"{name} {label}"


def test_gpt2_switches_name_its_own_layers(architectures) -> None:
    directory = architectures.path("gpt2")
    attention = tinker_config(directory, SWITCHES["attention"]).lora
    assert attention.target_modules == ("c_attn", "attn.c_proj")
    mlp_only = tinker_config(directory, SWITCHES["mlp"]).lora
    assert mlp_only.target_modules == ("c_fc", "mlp.c_proj")


def test_expert_weights_are_adapted_as_parameters(architectures) -> None:
    for name in ("gpt-oss", "qwen3-moe"):
        lora = tinker_config(architectures.path(name), SWITCHES["mlp"]).lora
        assert (lora.target_modules, lora.target_parameters) == ((), ("gate_up_proj", "down_proj"))
        assert lora.dropout == 0.0


@pytest.fixture
def mamba(tmp_path: Path) -> Path:
    """A model with neither attention nor MLP blocks (a state-space mixer), by its config."""
    directory = tmp_path / "models" / "mamba"
    MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=64, state_size=4).save_pretrained(
        directory
    )
    return directory


def test_a_switch_that_matches_nothing_is_refused_naming_the_architecture(mamba) -> None:
    with pytest.raises(
        InvalidArgument,
        match=r"lora_config: train_attn matches no attn layer of MambaForCausalLM; "
        r"train_mlp matches no mlp layer of MambaForCausalLM",
    ):
        tinker_config(mamba, {})
    unembedding = tinker_config(mamba, SWITCHES["unembedding"]).lora
    assert unembedding.target_modules == ("lm_head",)


def test_the_front_answers_400_for_a_switch_without_layers_and_opens_gpt2_without_unembed(
    architectures, mamba, tmp_path
) -> None:
    model_root = mamba.parent
    shutil.copytree(architectures.path("gpt2"), model_root / "gpt2")
    with (
        tinker_server(tmp_path / "state", model_root) as handle,
        httpx.Client(
            base_url=f"{handle.tinker.base_url}/api/v1", headers={"X-API-Key": KEY}, timeout=60
        ) as client,
    ):
        session_id = client.post("/create_session", json={}).json()["session_id"]
        refused = client.post(
            "/create_model",
            json={"session_id": session_id, "base_model": "mamba", "lora_config": {"rank": 2}},
        )
        assert refused.status_code == 400
        assert "train_attn matches no attn layer of MambaForCausalLM" in refused.text
        wide = {"session_id": session_id, "base_model": "gpt2", "lora_config": {"rank": 10**5}}
        refused = client.post("/create_model", json=wide)  # a rank no weight can use: bounded
        assert refused.status_code == 400
        assert "rank 100000 is past what this model's weights can use" in refused.text
        lora_config = {"rank": 2, "train_unembed": False}
        opened = client.post(
            "/create_model",
            json={"session_id": session_id, "base_model": "gpt2", "lora_config": lora_config},
        )
        assert opened.status_code == 200, opened.text
