"""Sampling a snapshot the trainer has moved past: the snapshot's samples, bit for bit, and every
live bit back afterwards (full weights and LoRA, in process)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainwire.client import LoraSettings
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import FailedPrecondition
from trainwire.server.tinker.snapshots import SnapshotWeights, sample_from
from trainwire.testing import tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
OPTIONS = {"max_tokens": 8, "num_samples": 3, "temperature": 1.0, "seed": 7}


@pytest.fixture(params=["full", "lora"])
def session(request, llama_config) -> TrainingSession:
    lora = NO_DROPOUT_LORA if request.param == "lora" else None
    return TrainingSession(llama_config(lora=lora, lr_scheduler="constant"), device="cpu")


def train_a_step(session: TrainingSession) -> None:
    session.forward_backward(tiny_token_examples(4, vocab_size=len(session.tokenizer)))
    session.optim_step(learning_rate=5e-2)


def draw(session: TrainingSession, weights: SnapshotWeights, prompt: tuple[int, ...]):
    """Samples and prompt logprobs, the first prompt logprob (NaN: no context) left out."""
    samples, scored = sample_from(session, weights, prompt, prompt_logprobs=True, **OPTIONS)
    assert scored is not None and math.isnan(scored[0])
    return samples, scored[1:]


def test_an_old_snapshot_samples_as_it_did_and_the_live_bits_come_back(
    session: TrainingSession, tmp_path: Path
) -> None:
    prompt = tuple(session.tokenize(["the movie was"])[0])
    live = SnapshotWeights(live=True)
    at_snapshot = draw(session, live, prompt)
    session.export_weights(tmp_path / "snapshot")
    train_a_step(session)
    trained_digest = session.state_digest()
    trained = draw(session, live, prompt)
    assert trained[1] != at_snapshot[1]  # the step changed the model's logprobs

    assert draw(session, SnapshotWeights(live=False, export=tmp_path / "snapshot"), prompt) == (
        at_snapshot
    )
    assert session.state_digest() == trained_digest
    assert draw(session, live, prompt) == trained


def test_the_base_model_samples_as_before_any_training(
    session: TrainingSession, tiny_llama: Path
) -> None:
    prompt = tuple(session.tokenize(["the movie was"])[0])
    before = draw(session, SnapshotWeights(live=True), prompt)
    train_a_step(session)
    trained_digest = session.state_digest()
    base = SnapshotWeights(live=False, base_model=tiny_llama)
    assert draw(session, base, prompt) == before
    assert session.state_digest() == trained_digest


def test_a_pruned_snapshot_is_refused_with_the_fix(session: TrainingSession, tmp_path: Path):
    gone = SnapshotWeights(live=False, export=tmp_path / "sampler-seq-3")
    digest = session.state_digest()
    with pytest.raises(FailedPrecondition, match=r"pruned.*save_weights_and_get_sampling_client"):
        draw(session, gone, (1, 2, 3))
    assert session.state_digest() == digest
