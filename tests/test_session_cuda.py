"""The engine on a CUDA device: fp32 and bf16, full weights and LoRA, both tasks.

Skipped without CUDA (the ``cuda`` marker); a CPU skip is not GPU qualification. Runs with
deterministic algorithms, so equal operations give equal bits and digests compare exactly, as on
the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from peft import PeftModel
from plans import drive_plan
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from trainwire.client import ManagedTrainingPlan
from trainwire.server.engine.loss.loss_hook import LossHook
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import FailedPrecondition
from trainwire.testing import tiny_sentiment_examples, tiny_text_examples

# cuBLAS reads this when it initializes; deterministic algorithms refuse to run without it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.cuda

PRECISIONS = ["fp32", "bf16"]
WEIGHTS = ["full", "lora"]
TASKS = ["causal-lm", "sequence-classification"]
# 9 examples in batches of 3, accumulation 2, 2 epochs: 6 microbatches, updates after 2 and 3
# microbatches of each epoch (the second a partial accumulation of 1).
PLAN_SETTINGS = {"gradient_accumulation_steps": 2, "num_epochs": 2, "warmup_steps": 1}


@pytest.fixture(scope="module", autouse=True)
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture(params=PRECISIONS)
def precision(request) -> str:
    if request.param == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    return request.param


@pytest.fixture
def make_plan(llama_config, bert_classifier_config, small_lora, precision):
    """``make_plan(task, weights)``: a small plan on the CUDA precision under test."""

    def make(task: str, weights: str) -> ManagedTrainingPlan:
        lora = small_lora if weights == "lora" else None
        if task == "causal-lm":
            config = llama_config(lora=lora, precision=precision, **PLAN_SETTINGS)
            return ManagedTrainingPlan(tiny_text_examples(9), config)
        config = bert_classifier_config(lora=lora, precision=precision, **PLAN_SETTINGS)
        return ManagedTrainingPlan(tiny_sentiment_examples(9), config)

    return make


def open_cuda_session(plan: ManagedTrainingPlan) -> TrainingSession:
    return TrainingSession(plan.config, device="cuda", max_steps=plan.max_steps)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_cuda_resume_mid_accumulation_equals_uninterrupted_run(
    make_plan, task, weights, precision, tmp_path
) -> None:
    plan = make_plan(task, weights)
    assert plan.batch_count == 6 and not plan.is_update(0) and plan.is_update(2)
    reference = open_cuda_session(plan)
    losses = drive_plan(reference, plan)
    assert all(torch.isfinite(torch.tensor(losses)))
    if precision == "bf16":
        dtypes = {p.dtype for n, p in reference.model.named_parameters() if "lora_" not in n}
        assert dtypes == {torch.bfloat16}

    again = open_cuda_session(plan)
    assert drive_plan(again, plan) == losses
    assert again.state_digest() == reference.state_digest()

    session = open_cuda_session(plan)
    saved = {}

    def save(i: int, op: str) -> None:
        if (i, op) in {(0, "forward_backward"), (2, "optim_step"), (3, "forward_backward")}:
            saved[(i, op)] = tmp_path / f"after-{i}-{op}"
            session.save_state(saved[(i, op)])

    drive_plan(session, plan, after_op=save)
    assert session.state_digest() == reference.state_digest()
    for (i, op), path in saved.items():
        resumed = open_cuda_session(plan)
        resumed.load_state(path)
        if op == "forward_backward" and plan.is_update(i):
            resumed.optim_step()
        assert drive_plan(resumed, plan, i + 1) == losses[i + 1 :]
        assert resumed.state_digest() == reference.state_digest(), f"resume after {i} {op}"


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_cuda_export_reloads_natively_with_the_same_loss(
    make_plan, task, weights, precision, tmp_path
) -> None:
    plan = make_plan(task, weights)
    session = open_cuda_session(plan)
    drive_plan(session, plan, 0, 3)
    session.export_weights(tmp_path / "export")

    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    dtype = session.dtype
    if weights == "full":
        model = auto.from_pretrained(tmp_path / "export", dtype=dtype, local_files_only=True)
    else:
        base = auto.from_pretrained(session.model_dir, dtype=dtype, local_files_only=True)
        model = PeftModel.from_pretrained(base, tmp_path / "export")
    model = model.to("cuda").eval()
    examples = plan.batch(3)
    # The session's own loss computation on the loaded export: transformers' causal-lm loss
    # sums the same terms in another order than the chunked one (``chunked_logprobs``).
    with torch.no_grad():
        batch = session.encoder.encode(examples)
        loss = LossHook(session.config).compute_loss(model, batch, training=False).loss.item()
    assert loss == session.forward(examples).loss


def test_cuda_sessions_interleaved_keep_their_own_rng(make_plan) -> None:
    plan = make_plan("causal-lm", "lora")
    alone = open_cuda_session(plan)
    drive_plan(alone, plan)
    a, b = open_cuda_session(plan), open_cuda_session(plan)
    for i in range(plan.batch_count):
        for session in (a, b):
            torch.rand(2, device="cuda")  # a third party drawing from the global generator
            drive_plan(session, plan, i, i + 1)
    assert a.state_digest() == b.state_digest() == alone.state_digest()


def test_cuda_gradient_checkpointing_gives_the_same_bits(make_plan) -> None:
    plan = make_plan("causal-lm", "lora")
    plain = open_cuda_session(plan)
    checkpointed = TrainingSession(
        plan.config.replace(gradient_checkpointing=True), device="cuda", max_steps=plan.max_steps
    )
    assert drive_plan(plain, plan) == drive_plan(checkpointed, plan)
    assert plain.state_digest() == checkpointed.state_digest()


def test_a_cuda_checkpoint_is_refused_by_a_cpu_session(make_plan, tmp_path, precision) -> None:
    if precision != "fp32":
        pytest.skip("bf16 sessions cannot run on the CPU at all")
    plan = make_plan("causal-lm", "full")
    session = open_cuda_session(plan)
    session.forward_backward(plan.batch(0))
    session.save_state(tmp_path / "checkpoint")
    cpu = TrainingSession(plan.config, device="cpu", max_steps=plan.max_steps)
    assert cpu.rng_state.cuda == [], "a CPU session's state must not depend on the CUDA generators"
    with pytest.raises(FailedPrecondition, match="device type: saved cuda, now cpu"):
        cpu.load_state(tmp_path / "checkpoint")
    assert cpu.is_fresh
