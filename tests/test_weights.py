"""Weights in and out: load_weights from every source, export_weights for transformers and peft.

A load copies weights only (the run keeps its optimizer, schedule and RNG), and a refused load
changes nothing. An export reloads natively and reproduces the session's losses exactly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from fresh_state import fresh_digest
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trainwire.client import LoraSettings
from trainwire.server.engine.loss.loss_hook import LossHook
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session import checkpoint as ckpt
from trainwire.server.engine.session.digest import update_with_tensors
from trainwire.server.engine.weights import transfer as weights
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.testing import make_tiny_model, tiny_sentiment_examples, tiny_text_examples

TASKS = ["causal-lm", "sequence-classification"]


def parameter_digest(named: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    update_with_tensors(digest, named)
    return digest.hexdigest()


def params(session: TrainingSession, *, adapters: bool | None = None) -> dict[str, torch.Tensor]:
    """The session's parameters; only adapters (True), only the rest (False) or all (None)."""
    return {
        name: p.detach().clone()
        for name, p in session.model.named_parameters()
        if adapters is None or ("lora_" in name) == adapters
    }


def optimizer_digest(session: TrainingSession) -> str:
    return parameter_digest(ckpt.optimizer_state_tensors(session.optimizer))


@pytest.fixture
def task_setup(request, llama_config, bert_classifier_config):
    """(config factory, examples, Auto class) for the task named by the test's parameter."""
    if request.param == "causal-lm":
        return llama_config, tiny_text_examples(6), AutoModelForCausalLM
    return bert_classifier_config, tiny_sentiment_examples(6), AutoModelForSequenceClassification


def trained(config, examples, steps: int = 2) -> TrainingSession:
    """A session after ``steps`` updates, on the first and last three examples in turn."""
    session = TrainingSession(config, max_steps=steps)
    for step in range(steps):
        session.forward_backward(examples[:3] if step % 2 == 0 else examples[3:])
        session.optim_step()
    return session


# -- load_weights ---------------------------------------------------------------------------


def test_load_weights_from_a_checkpoint_keeps_the_optimizer_step_and_rng(
    llama_config, small_lora, tmp_path
) -> None:
    examples = tiny_text_examples(6)
    source = trained(llama_config(lora=small_lora), examples)
    source.save_state(tmp_path / "checkpoint")

    # Another run (another learning rate): weights only come over.
    session = trained(llama_config(lora=small_lora, learning_rate=5e-4), examples[::-1], steps=1)
    session.forward_backward(examples[:2])
    before = (session.step, session.accumulated, optimizer_digest(session))
    rng, own_weights = session.rng_state.fingerprint(), params(session)
    pending = {name: g.clone() for name, g in session.pending_gradients().items()}
    digest = fresh_digest(session)
    session.load_weights(tmp_path / "checkpoint")

    assert parameter_digest(params(session)) == parameter_digest(params(source))
    assert (session.step, session.accumulated, optimizer_digest(session)) == before
    assert session.rng_state.fingerprint() == rng
    assert parameter_digest(session.pending_gradients()) == parameter_digest(pending)
    assert parameter_digest(params(session)) != parameter_digest(own_weights)
    assert session.state_digest() != digest
    session.optim_step()


@pytest.mark.parametrize("shards", [None, 2], ids=["single-file", "sharded"])
def test_load_weights_from_a_native_model_directory(llama_config, model_root, shards) -> None:
    directory = make_tiny_model(model_root / f"llama-shards-{shards}", shards=shards)
    if shards:
        assert (directory / weights.SHARD_INDEX_FILE).is_file()
        assert len(list(directory.glob("model-*.safetensors"))) == 2
    fresh = TrainingSession(llama_config())
    session = trained(llama_config(), tiny_text_examples(6))
    assert parameter_digest(params(session)) != parameter_digest(params(fresh))
    session.load_weights(directory)
    assert parameter_digest(params(session)) == parameter_digest(params(fresh))
    assert session.step == 2


@pytest.mark.parametrize("task_setup", TASKS, indirect=True)
def test_a_full_model_seeds_fresh_lora_adapters(task_setup, small_lora, tmp_path) -> None:
    factory, examples, _ = task_setup
    full = trained(factory(), examples)
    full.export_weights(tmp_path / "full")

    session = TrainingSession(factory(lora=small_lora))
    adapters = params(session, adapters=True)
    base_fingerprint = session.base_fingerprint
    session.load_weights(tmp_path / "full")

    assert parameter_digest(params(session, adapters=True)) == parameter_digest(adapters)
    trained_weights = params(full)
    for name, parameter in params(session, adapters=False).items():
        assert torch.equal(parameter, trained_weights[weights.native_name(name)]), name
    assert session.base_fingerprint != base_fingerprint
    session.forward_backward(examples[:3])


@pytest.mark.parametrize("task_setup", TASKS, indirect=True)
def test_a_peft_adapter_continues_without_reinitialization(
    task_setup, small_lora, tmp_path
) -> None:
    factory, examples, _ = task_setup
    source = trained(factory(lora=small_lora), examples)
    source.export_weights(tmp_path / "adapter")

    session = TrainingSession(factory(lora=small_lora))
    assert parameter_digest(params(session)) != parameter_digest(params(source))
    session.load_weights(tmp_path / "adapter")
    assert parameter_digest(params(session)) == parameter_digest(params(source))
    assert session.step == 0 and optimizer_digest(session) == optimizer_digest(
        TrainingSession(factory(lora=small_lora))
    )


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (LoraSettings(r=2, alpha=8, dropout=0.1), r"r: saved 2, now 4"),
        (LoraSettings(r=4, alpha=16, dropout=0.1), r"alpha: saved 16, now 8"),
        (LoraSettings(r=4, alpha=8, dropout=0.0), r"dropout: saved 0\.0, now 0\.1"),
        (
            LoraSettings(r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "v_proj")),
            r"target_modules: saved \['q_proj', 'v_proj'\], now \['model.layers.0.mlp.down_proj', ",
        ),
        (
            LoraSettings(r=4, alpha=8, dropout=0.1, use_dora=True),
            r"use_dora: saved True, now False",
        ),
    ],
    ids=["r", "alpha", "dropout", "targets", "dora"],
)
def test_a_mismatched_adapter_is_refused_naming_the_difference(
    llama_config, small_lora, tmp_path, lora, message
) -> None:
    TrainingSession(llama_config(lora=lora)).export_weights(tmp_path / "adapter")
    session = TrainingSession(llama_config(lora=small_lora))
    digest = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=rf"adapter adapter does not match: .*{message}"):
        session.load_weights(tmp_path / "adapter")
    assert fresh_digest(session) == digest


def test_an_adapter_trained_on_another_base_is_refused(
    llama_config, small_lora, model_root, tmp_path
) -> None:
    other_base = make_tiny_model(model_root / "llama-seed-1", seed=1)
    TrainingSession(llama_config(model=str(other_base), lora=small_lora)).export_weights(
        tmp_path / "adapter"
    )
    session = TrainingSession(llama_config(lora=small_lora))
    digest = fresh_digest(session)
    with pytest.raises(
        InvalidArgument, match=r"trained on another base model: saved sha256:\w+, now sha256:\w+"
    ):
        session.load_weights(tmp_path / "adapter")
    assert fresh_digest(session) == digest


@pytest.fixture
def damaged_llama(tiny_llama, tmp_path):
    """``damaged_llama(change)``: a copy of the tiny llama whose tensors ``change`` rewrites."""

    def make(change) -> Path:
        directory = tmp_path / "damaged"
        shutil.copytree(tiny_llama, directory)
        tensors = load_file(directory / ckpt.MODEL_FILE)
        change(tensors)
        save_file(tensors, directory / ckpt.MODEL_FILE, metadata={"format": "pt"})
        return directory

    return make


def _perturb_first_then(damage):
    """Change the first tensor by name (a valid change) and damage a later one."""

    def change(tensors: dict[str, torch.Tensor]) -> None:
        first = sorted(tensors)[0]
        tensors[first] = tensors[first] + 1
        damage(tensors)

    return change


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:-1]}),
            r"model\.norm\.weight: shape \(31,\), model has \(32,\)",
        ),
        (
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"].bfloat16()}),
            r"model\.norm\.weight: dtype torch\.bfloat16, model has torch\.float32",
        ),
        (lambda t: t.pop("model.norm.weight"), r"missing 1 tensor\(s\): model\.norm\.weight"),
        (
            lambda t: t.update({"model.extra.weight": torch.zeros(2)}),
            r"unexpected 1 tensor\(s\): model\.extra\.weight",
        ),
    ],
    ids=["shape", "dtype", "missing", "unexpected"],
)
def test_weights_that_do_not_fit_are_refused_before_any_live_tensor_changes(
    llama_config, small_lora, damaged_llama, damage, message
) -> None:
    directory = damaged_llama(_perturb_first_then(damage))
    for lora in (None, small_lora):
        session = TrainingSession(llama_config(lora=lora))
        digest = fresh_digest(session)
        with pytest.raises(
            InvalidArgument, match=rf"the weights do not fit this model: .*{message}"
        ):
            session.load_weights(directory)
        assert fresh_digest(session) == digest


def test_sources_of_the_wrong_kind_are_refused(
    llama_config, small_lora, tiny_bert_classifier, tmp_path
) -> None:
    lora_session = TrainingSession(llama_config(lora=small_lora))
    lora_session.export_weights(tmp_path / "adapter")
    lora_session.save_state(tmp_path / "lora-checkpoint")
    session = TrainingSession(llama_config())
    digest = fresh_digest(session)
    with pytest.raises(FailedPrecondition, match="is a LoRA adapter, but this session trains full"):
        session.load_weights(tmp_path / "adapter")
    with pytest.raises(InvalidArgument, match="lora-checkpoint was trained with other settings"):
        session.load_weights(tmp_path / "lora-checkpoint")
    with pytest.raises(InvalidArgument, match="the weights do not fit this model: missing"):
        session.load_weights(tiny_bert_classifier)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="neither a session checkpoint, a PEFT adapter nor"):
        session.load_weights(tmp_path / "empty")
    with pytest.raises(NotFound, match="no weights at"):
        session.load_weights(tmp_path / "missing")
    assert fresh_digest(session) == digest


# -- export_weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("task_setup", TASKS, indirect=True)
def test_a_full_export_reloads_with_transformers_and_gives_the_same_loss(
    task_setup, tmp_path
) -> None:
    factory, examples, auto_class = task_setup
    session = trained(factory(), examples)
    session.export_weights(tmp_path / "export")

    record = json.loads((tmp_path / "export" / weights.EXPORT_FILE).read_text())
    assert (record["kind"], record["step"]) == ("full", 2)
    assert record["state_digest"] == session.state_digest()
    model = auto_class.from_pretrained(tmp_path / "export", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export", local_files_only=True)
    assert (
        tokenizer(examples[0].text)["input_ids"] == session.tokenizer(examples[0].text)["input_ids"]
    )
    assert exported_loss(session, model, examples) == session.forward(examples).loss


def exported_loss(session: TrainingSession, model: torch.nn.Module, examples) -> float:
    """The session's loss computation run on the loaded export: the same weights give the same
    bits (transformers' own causal-lm loss sums the same terms in another order)."""
    model.eval()
    with torch.no_grad():
        batch = session.encoder.encode(examples)
        return LossHook(session.config).compute_loss(model, batch, training=False).loss.item()


@pytest.mark.parametrize("task_setup", TASKS, indirect=True)
def test_an_adapter_export_loads_with_peft_and_gives_the_same_loss(
    task_setup, small_lora, tmp_path
) -> None:
    factory, examples, auto_class = task_setup
    session = trained(factory(lora=small_lora), examples)
    session.export_weights(tmp_path / "adapter")

    record = json.loads((tmp_path / "adapter" / weights.EXPORT_FILE).read_text())
    assert record["kind"] == "adapter"
    assert record["base_model_fingerprint"] == session.base_fingerprint
    base = auto_class.from_pretrained(session.model_dir, local_files_only=True)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert exported_loss(session, model, examples) == session.forward(examples).loss


@pytest.mark.parametrize("task_setup", TASKS, indirect=True)
def test_a_trained_export_starts_another_run(task_setup, tmp_path) -> None:
    factory, examples, _ = task_setup
    session = trained(factory(), examples)
    session.export_weights(tmp_path / "export")

    successor = TrainingSession(factory(model=str(tmp_path / "export")), max_steps=1)
    assert successor.forward(examples).loss == session.forward(examples).loss
    assert parameter_digest(params(successor)) == parameter_digest(params(session))
    successor.forward_backward(examples[:3])
    assert successor.optim_step().step == 1


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_checkpoint_weights_leaves_the_live_state_alone(
    llama_config, small_lora, tmp_path, lora
) -> None:
    config = llama_config(lora=small_lora if lora else None, lr_scheduler="constant")
    examples = tiny_text_examples(6)
    session = trained(config, examples, steps=1)
    session.save_state(tmp_path / "checkpoint")
    session.forward_backward(examples[3:])
    session.optim_step()
    session.forward_backward(examples[:3])
    digest = fresh_digest(session)

    session.export_checkpoint_weights(tmp_path / "checkpoint", tmp_path / "from-checkpoint")
    assert fresh_digest(session) == digest

    restored = TrainingSession(config, max_steps=1)
    restored.load_state(tmp_path / "checkpoint")
    restored.export_weights(tmp_path / "restored")
    name = weights.ADAPTER_WEIGHTS_FILE if lora else ckpt.MODEL_FILE
    exported = load_file(tmp_path / "from-checkpoint" / name)
    expected = load_file(tmp_path / "restored" / name)
    assert parameter_digest(exported) == parameter_digest(expected)
    live = load_file(tmp_path / "restored" / name)
    session.export_weights(tmp_path / "live")
    assert parameter_digest(load_file(tmp_path / "live" / name)) != parameter_digest(live)
    record = json.loads((tmp_path / "from-checkpoint" / weights.EXPORT_FILE).read_text())
    assert record["step"] == 1
