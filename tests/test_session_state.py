"""Session checkpoints: a resume from any point of a plan equals the uninterrupted run, bit for bit.

The resume-equivalence pattern (train, save, restore into a fresh session, finish, compare the
state digests) is applied at every microbatch of a small plan, before and after its update, for
both tasks, full weights and LoRA. A checkpoint holds the complete state as safetensors and JSON,
replaces an older one whole, carries a caller's extra JSON, and a loss hook's own state rides in it
(and in the digest). Its refusals are in test_session_state_refusals.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from fresh_state import fresh_digest
from plans import drive_plan
from safetensors.torch import load_file

from trainwire.client import ManagedTrainingPlan, TrainingConfig
from trainwire.server.engine.session import LossHook, TrainingSession
from trainwire.server.engine.session import checkpoint as ckpt
from trainwire.server.errors import InvalidArgument
from trainwire.testing import tiny_sentiment_examples, tiny_text_examples

# 11 examples in batches of 3 give 4 microbatches an epoch (the last holds 2); with accumulation 3
# an epoch has one full accumulation and one partial one (a single microbatch at the epoch end).
PLAN_SETTINGS = {"gradient_accumulation_steps": 3, "num_epochs": 2, "warmup_steps": 1}
EXAMPLE_COUNT = 11

VARIANTS = ["causal-lm-full", "causal-lm-lora", "classification-full", "classification-lora"]


@pytest.fixture(params=VARIANTS)
def plan(request, llama_config, bert_classifier_config, small_lora) -> ManagedTrainingPlan:
    """A small plan for one task and weight kind: 8 microbatches, 4 updates, uneven batches."""
    task, kind = request.param.rsplit("-", 1)
    lora = small_lora if kind == "lora" else None
    if task == "causal-lm":
        config = llama_config(lora=lora, **PLAN_SETTINGS)
        examples = tiny_text_examples(EXAMPLE_COUNT)
    else:
        config = bert_classifier_config(lora=lora, **PLAN_SETTINGS)
        examples = tiny_sentiment_examples(EXAMPLE_COUNT)
    return ManagedTrainingPlan(examples, config)


def open_session(plan: ManagedTrainingPlan, **kwargs) -> TrainingSession:
    return TrainingSession(plan.config, max_steps=plan.max_steps, **kwargs)


def finish_from(session: TrainingSession, plan: ManagedTrainingPlan, i: int, op: str):
    """Continue a session restored right after operation ``op`` of microbatch ``i``."""
    if op == "forward_backward" and plan.is_update(i):
        session.optim_step()
    return drive_plan(session, plan, i + 1)


def test_resume_at_every_microbatch_equals_uninterrupted_run(plan, tmp_path) -> None:
    assert plan.batch_count == 8 and plan.max_steps == 4
    assert any(len(plan.rows(i)) < plan.config.batch_size for i in range(plan.batch_count))
    reference = open_session(plan)
    reference_losses = drive_plan(reference, plan)

    session = open_session(plan)
    saved = []  # (microbatch, operation, checkpoint, digest at save)

    def save(i: int, op: str) -> None:
        digest = fresh_digest(session)
        path = tmp_path / f"after-{i}-{op}"
        session.save_state(path)
        assert fresh_digest(session) == digest, "saving changed the state"
        saved.append((i, op, path, digest))

    losses = drive_plan(session, plan, after_op=save)
    assert losses == reference_losses
    assert session.state_digest() == reference.state_digest()
    assert len(saved) == plan.batch_count + plan.max_steps
    assert any(json.loads((p / ckpt.SESSION_FILE).read_text())["accumulated"] for *_, p, _ in saved)

    for i, op, path, digest in saved:
        resumed = open_session(plan)
        resumed.load_state(path)
        assert fresh_digest(resumed) == digest, f"restore after microbatch {i} {op}"
        assert finish_from(resumed, plan, i, op) == reference_losses[i + 1 :]
        assert resumed.state_digest() == reference.state_digest(), f"resume after {i} {op}"


def test_checkpoint_holds_the_complete_state_as_safetensors_and_json(
    llama_config, small_lora, tmp_path
) -> None:
    config = llama_config(lora=small_lora, lr_scheduler="constant")
    session = TrainingSession(config)
    examples = tiny_text_examples(6)
    session.forward_backward(examples[:3])
    session.optim_step()
    session.forward_backward(examples[3:])
    session.save_state(tmp_path / "checkpoint")

    files = sorted(path.name for path in (tmp_path / "checkpoint").iterdir())
    assert files == sorted(
        [
            ckpt.SESSION_FILE,
            ckpt.MODEL_FILE,
            ckpt.OPTIMIZER_FILE,
            ckpt.GRADIENTS_FILE,
            ckpt.RNG_FILE,
            ckpt.LOSS_HOOK_FILE,
        ]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"], "a temporary was left behind"
    meta = json.loads((tmp_path / "checkpoint" / ckpt.SESSION_FILE).read_text())
    assert meta["config_fingerprint"] == config.fingerprint()
    assert meta["config"] == config.to_dict()
    assert (meta["step"], meta["accumulated"], meta["device_type"]) == (1, 1, "cpu")
    assert meta["state_digest"] == session.state_digest()
    assert meta["base_model_fingerprint"] == session.base_fingerprint
    gradients = load_file(tmp_path / "checkpoint" / ckpt.GRADIENTS_FILE)
    assert set(gradients) == {n for n, p in session.model.named_parameters() if p.requires_grad}
    optimizer = load_file(tmp_path / "checkpoint" / ckpt.OPTIMIZER_FILE)
    assert len(optimizer) == 3 * len(session.trainable_parameters())  # step, exp_avg, exp_avg_sq
    assert "torch_cpu" in load_file(tmp_path / "checkpoint" / ckpt.RNG_FILE)


def test_save_over_an_existing_checkpoint_replaces_it_whole(llama_config, tmp_path) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    session.save_state(tmp_path / "checkpoint")
    session.forward_backward(tiny_text_examples(3))
    session.save_state(tmp_path / "checkpoint")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]
    restored = TrainingSession(llama_config(lr_scheduler="constant"))
    restored.load_state(tmp_path / "checkpoint")
    assert restored.state_digest() == session.state_digest()
    assert restored.accumulated == 1


def test_save_state_carries_extra_json_back_from_load_state(llama_config, tmp_path) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    session.save_state(tmp_path / "checkpoint", extra={"cursor": 3, "history": [1.5]})
    restored = TrainingSession(llama_config(lr_scheduler="constant"))
    assert restored.load_state(tmp_path / "checkpoint") == {"cursor": 3, "history": [1.5]}


# -- the extension point: a trainer's own state rides in the checkpoint -----------------------


class LossSumTrainer(LossHook):
    """Keeps a running sum of training losses: state the session must save and digest."""

    def __init__(self, config: TrainingConfig) -> None:
        super().__init__(config)
        self.loss_sum = torch.zeros((), dtype=torch.float64)

    def compute_loss(self, model, batch, *, training):
        output = super().compute_loss(model, batch, training=training)
        if training:
            self.loss_sum += output.loss.detach().double()
        return output

    def session_state_dict(self) -> dict[str, torch.Tensor]:
        return {"loss_sum": self.loss_sum}

    def load_session_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != {"loss_sum"}:
            raise InvalidArgument(f"LossSumTrainer keeps loss_sum, the checkpoint {sorted(state)}")
        self.loss_sum = state["loss_sum"].clone()


def test_a_custom_trainer_state_rides_in_the_checkpoint_and_the_digest(
    llama_config, small_lora, tmp_path
) -> None:
    config = llama_config(lora=small_lora, gradient_accumulation_steps=2)
    plan = ManagedTrainingPlan(tiny_text_examples(9), config)
    reference = TrainingSession(config, max_steps=plan.max_steps, loss_hook=LossSumTrainer)
    losses = drive_plan(reference, plan)
    assert reference.loss_hook.loss_sum.item() == sum(torch.tensor(losses).double().tolist())
    plain = TrainingSession(config, max_steps=plan.max_steps)
    drive_plan(plain, plan)
    assert plain.state_digest() != reference.state_digest(), "the trainer state is not digested"

    session = TrainingSession(config, max_steps=plan.max_steps, loss_hook=LossSumTrainer)
    drive_plan(session, plan, 0, 1)
    session.save_state(tmp_path / "checkpoint")
    resumed = TrainingSession(config, max_steps=plan.max_steps, loss_hook=LossSumTrainer)
    resumed.load_state(tmp_path / "checkpoint")
    assert torch.equal(resumed.loss_hook.loss_sum, session.loss_hook.loss_sum)
    drive_plan(resumed, plan, 1)
    assert resumed.state_digest() == reference.state_digest()
    assert torch.equal(resumed.loss_hook.loss_sum, reference.loss_hook.loss_sum)

    stranger = TrainingSession(config, max_steps=plan.max_steps)
    with pytest.raises(InvalidArgument, match=r"trainer state \(loss_sum\).*LossHook"):
        stranger.load_state(tmp_path / "checkpoint")
    assert stranger.is_fresh
    fresh = TrainingSession(config, max_steps=plan.max_steps)
    assert stranger.state_digest() == fresh.state_digest()
