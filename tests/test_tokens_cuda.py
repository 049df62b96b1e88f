"""Token-level training and sampling on a CUDA device: fp32 and bf16, full weights and LoRA.

Skipped without CUDA (the ``cuda`` marker). Deterministic algorithms, so a resumed run and a
sample's recomputed logprobs compare exactly, as on the CPU. ``bench/gpu.sh`` runs these.
"""

from __future__ import annotations

import os

import pytest
import torch

from trainwire.client import LoraSettings, TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_token_examples

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.cuda

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


@pytest.fixture(scope="module", autouse=True)
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture(params=[("fp32", None), ("fp32", "lora"), ("bf16", None), ("bf16", "lora")])
def config(request, llama_config):
    precision, weights = request.param
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no native bf16")
    lora = NO_DROPOUT_LORA if weights else None
    return llama_config(lora=lora, precision=precision, lr_scheduler="constant")


def test_token_losses_train_and_resume_bit_exact_on_cuda(config, tmp_path):
    def run(session: TrainingSession, *, save=None, resume=None) -> str:
        if resume is None:
            session.forward_backward(tiny_token_examples(3, seed=1), loss_fn="ppo")
            session.optim_step()
            if save is not None:
                session.save_state(save)
        else:
            session.load_state(resume)
        session.forward_backward(tiny_token_examples(3, seed=2), loss_fn="importance_sampling")
        session.optim_step(learning_rate=5e-4)
        return session.state_digest()

    uninterrupted = run(TrainingSession(config, device="cuda"))
    assert run(TrainingSession(config, device="cuda"), save=tmp_path / "c") == uninterrupted
    assert run(TrainingSession(config, device="cuda"), resume=tmp_path / "c") == uninterrupted


def test_samples_on_cuda_carry_the_logprobs_forward_gives_them(config):
    session = TrainingSession(config, device="cuda")
    prompt = session.tokenize(["the movie was"])[0]
    samples = session.sample(prompt, max_tokens=8, num_samples=3, seed=7)
    assert session.sample(prompt, max_tokens=8, num_samples=3, seed=7) == samples
    for sample in samples:
        full = [*prompt, *sample.tokens]
        logprobs = session.forward([TokenExample(full[:-1], full[1:])]).logprobs[0]
        assert tuple(logprobs[len(prompt) - 1 :]) == sample.logprobs
