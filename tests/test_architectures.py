"""Every architecture users bring trains, resumes, exports, loads and samples exactly.

The matrix: each tiny random-init model of ``trainwire.testing.ARCHITECTURES`` (built offline from
its transformers config class, with the test tokenizer), in full and in LoRA. LoRA adapts every
role the Tinker front's switches name (attention, MLP, unembedding: expert weights through
``target_parameters``) on causal models, and every linear layer of a classifier. Each case takes
an update, resumes exactly from a checkpoint, exports weights that ``from_pretrained`` (and
``peft``) reloads to the same logits bit for bit, loads that export and the base model back
through ``load_weights``, and, for causal models, samples with the trainer's own logprobs (from
the live weights, the export and the base model alike).

A new architecture is one line in ``ARCHITECTURES``; the ones outside ``FAST`` run in the slow
suite.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from architecture_models import ArchitectureModels, examples, is_causal, matrix
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trainwire.client import LoraSettings, TokenExample
from trainwire.server.engine.sampling.sample_weights import BASE_MODEL
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session.digest import update_with_tensors
from trainwire.server.engine.weights.module_roles import ROLES, model_role_targets

ARCHITECTURE_MATRIX = matrix(pytest.mark.slow)


@pytest.fixture(scope="module")
def architectures(model_root: Path) -> ArchitectureModels:
    return ArchitectureModels(model_root)


def lora_for(architectures: ArchitectureModels, name: str) -> LoraSettings:
    """Rank 2 on every role of a causal model (as the Tinker front's switches all on), every
    linear layer of a classifier; no dropout, which adapters on parameters refuse."""
    if not is_causal(name):
        return LoraSettings(r=2, alpha=4)
    targets = model_role_targets(architectures.path(name), ROLES)
    return LoraSettings(
        r=2, alpha=4, target_modules=targets.modules, target_parameters=targets.parameters
    )


def parameter_digest(session: TrainingSession, *, adapters_only: bool = False) -> str:
    digest = hashlib.sha256()
    named = session.model.named_parameters()
    update_with_tensors(digest, {n: p for n, p in named if "lora_" in n or not adapters_only})
    return digest.hexdigest()


def trained_and_resumed(config, batch, checkpoint: Path) -> TrainingSession:
    """Two updates, with a checkpoint between them that a second session resumes from: it
    must reach the very same state."""
    session = TrainingSession(config)
    session.forward_backward(batch[:2])
    session.optim_step()
    session.save_state(checkpoint)
    session.forward_backward(batch[2:])
    session.optim_step()
    resumed = TrainingSession(config)
    resumed.load_state(checkpoint)
    resumed.forward_backward(batch[2:])
    resumed.optim_step()
    assert resumed.state_digest() == session.state_digest()
    return session


def reloaded(name: str, export: Path, base: Path, lora: bool) -> torch.nn.Module:
    """The export as an inference user loads it: transformers, plus peft for an adapter."""
    auto = AutoModelForCausalLM if is_causal(name) else AutoModelForSequenceClassification
    if not lora:
        return auto.from_pretrained(export, local_files_only=True).eval()
    base_model = auto.from_pretrained(base, local_files_only=True)
    return PeftModel.from_pretrained(base_model, export).eval()


def live_logits(session: TrainingSession, batch) -> torch.Tensor:
    session.forward(batch)  # puts the model in evaluation mode, as an inference user runs it
    with torch.no_grad():
        return session.model(**session.encoder.encode(batch).inputs).logits


def assert_samples_carry_the_trainers_logprobs(session: TrainingSession) -> None:
    prompt = session.tokenize(["the movie was"])[0]
    for sample in session.sample(prompt, max_tokens=6, num_samples=2, seed=1):
        full = [*prompt, *sample.tokens]
        logprobs = session.forward([TokenExample(full[:-1], full[1:])]).logprobs[0]
        assert tuple(logprobs[len(prompt) - 1 :]) == sample.logprobs


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("name", ARCHITECTURE_MATRIX)
def test_an_architecture_trains_resumes_exports_loads_and_samples_exactly(
    architectures, name, mode, tmp_path
) -> None:
    lora = lora_for(architectures, name) if mode == "lora" else None
    config = architectures.config(name, lora=lora)
    batch = examples(name)
    session = trained_and_resumed(config, batch, tmp_path / "checkpoint")

    session.export_weights(tmp_path / "export")
    model = reloaded(name, tmp_path / "export", architectures.path(name), lora is not None)
    with torch.no_grad():
        exported = model(**session.encoder.encode(batch).inputs).logits
    assert torch.equal(exported, live_logits(session, batch))

    fresh = TrainingSession(config)
    untouched = parameter_digest(fresh)
    fresh.load_weights(tmp_path / "export")
    assert parameter_digest(fresh) == parameter_digest(session)
    # The base model: in full it takes every weight back; in LoRA it seeds the base weights (and
    # a classifier's head), and the adapters stay as loaded.
    fresh.load_weights(architectures.path(name))
    if lora is None:
        assert parameter_digest(fresh) == untouched
    else:
        adapters = parameter_digest(session, adapters_only=True)
        assert parameter_digest(fresh, adapters_only=True) == adapters
    fresh.forward_backward(batch[:2])

    if is_causal(name):
        assert_samples_carry_the_trainers_logprobs(session)
        # The export and the base model sample as the sessions holding them do.
        prompt = session.tokenize(["the film"])[0]
        draw = {"max_tokens": 4, "num_samples": 2, "seed": 2}
        from_export = session.sample(prompt, weights=tmp_path / "export", **draw)
        assert from_export == session.sample(prompt, **draw)
        from_base = session.sample(prompt, weights=BASE_MODEL, **draw)
        assert from_base == TrainingSession(config).sample(prompt, **draw)
