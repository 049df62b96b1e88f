"""Sampling other weights than the live ones, inside the engine: an export of the run (a snapshot
the trainer has moved past) samples exactly as it did when it was live, the base model as a fresh
session, and every live bit, the digest and the training RNG are as they were afterwards. A
refused source changes nothing; a failure to put the live weights back breaks the session.
Exact equality throughout, on tiny real models (full weights and LoRA)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trainwire.client import LoraSettings, TokenExample
from trainwire.server.engine.sampling import weight_swap as session_sampling
from trainwire.server.engine.sampling.sample_weights import BASE_MODEL, SampleWeights
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.testing import tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
OPTIONS = {"max_tokens": 8, "num_samples": 3, "temperature": 1.0, "seed": 7}


@pytest.fixture(params=["full", "lora"])
def config(request, llama_config):
    lora = NO_DROPOUT_LORA if request.param == "lora" else None
    return llama_config(lora=lora, lr_scheduler="constant")


@pytest.fixture
def session(config) -> TrainingSession:
    return TrainingSession(config, device="cpu")


def train_a_step(session: TrainingSession, seed: int = 0) -> None:
    examples = tiny_token_examples(4, vocab_size=len(session.tokenizer), seed=seed)
    session.forward_backward(examples)
    session.optim_step(learning_rate=5e-2)


def prompt_of(session: TrainingSession) -> list[int]:
    return session.tokenize(["the movie was"])[0]


def draw(session: TrainingSession, weights=None):
    """Samples and prompt logprobs (the first, NaN, checked and left out) under ``weights``."""
    samples = session.sample(prompt_of(session), weights=weights, **OPTIONS)
    scored = session.prompt_logprobs(prompt_of(session), weights=weights)
    assert math.isnan(scored[0])
    return samples, scored[1:]


def live_bits(session: TrainingSession) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in session.model.named_parameters()}


def assert_unchanged(session: TrainingSession, bits: dict[str, torch.Tensor], digest: str) -> None:
    """Every parameter bit for bit, and the digest computed afresh, as before."""
    assert session.broken is None
    for name, parameter in session.model.named_parameters():
        assert torch.equal(parameter, bits[name]), name
    session.drop_digest_cache()
    assert session.state_digest() == digest


def test_an_export_samples_exactly_as_when_it_was_live_and_every_live_bit_comes_back(
    session: TrainingSession, tmp_path: Path
) -> None:
    at_export = draw(session)
    session.export_weights(tmp_path / "snapshot")
    train_a_step(session)
    trained = draw(session)
    trained_bits, trained_digest = live_bits(session), session.state_digest()
    assert trained[1] != at_export[1]  # the step moved the model's logprobs
    global_rng = torch.get_rng_state()

    assert draw(session, tmp_path / "snapshot") == at_export
    assert draw(session, str(tmp_path / "snapshot")) == at_export  # a path as a string too
    assert draw(session, SampleWeights(export=tmp_path / "snapshot")) == at_export
    assert_unchanged(session, trained_bits, trained_digest)
    assert torch.equal(torch.get_rng_state(), global_rng)
    assert draw(session) == trained


def test_the_base_model_samples_as_a_fresh_session(config, session: TrainingSession) -> None:
    fresh = TrainingSession(config, device="cpu")
    before = draw(fresh)
    train_a_step(session)
    trained = draw(session)
    assert trained != before
    trained_bits, trained_digest = live_bits(session), session.state_digest()

    assert draw(session, BASE_MODEL) == before
    assert draw(fresh, BASE_MODEL) == before
    assert_unchanged(session, trained_bits, trained_digest)
    assert draw(session) == trained  # under LoRA: the adapter is back in


def test_prompt_logprobs_are_forwards_under_the_weights_selected(
    session: TrainingSession, tmp_path: Path
) -> None:
    prompt = prompt_of(session)
    alone = TokenExample(prompt[:-1], prompt[1:])
    at_export = session.forward([alone]).logprobs[0]
    session.export_weights(tmp_path / "snapshot")
    train_a_step(session)
    assert session.prompt_logprobs(prompt)[1:] == list(session.forward([alone]).logprobs[0])
    assert session.prompt_logprobs(prompt, weights=tmp_path / "snapshot")[1:] == list(at_export)
    (only,) = session.prompt_logprobs(prompt[:1], weights=tmp_path / "snapshot")
    assert math.isnan(only)  # one token: nothing precedes it


def test_training_after_sampling_other_weights_gives_the_same_bits(
    llama_config, small_lora, tmp_path: Path
) -> None:
    # Dropout draws from the training RNG at every step: a sample that touched it would show.
    config = llama_config(lora=small_lora, lr_scheduler="constant")
    plain, sampled = (TrainingSession(config, device="cpu") for _ in range(2))
    sampled.export_weights(tmp_path / "snapshot")
    for step in range(2):
        for session in (plain, sampled):
            train_a_step(session, seed=step)
        for weights in (tmp_path / "snapshot", BASE_MODEL):
            draw(sampled, weights)
    assert sampled.state_digest() == plain.state_digest()


def test_a_missing_export_is_refused_and_changes_nothing(
    session: TrainingSession, tmp_path: Path
) -> None:
    train_a_step(session)
    bits, digest, live = live_bits(session), session.state_digest(), draw(session)
    gone = tmp_path / "sampler-seq-3"
    with pytest.raises(FailedPrecondition, match=r"no weights to sample at 'sampler-seq-3'"):
        session.sample(prompt_of(session), weights=gone, **OPTIONS)
    with pytest.raises(FailedPrecondition, match=r"no weights to sample at 'sampler-seq-3'"):
        session.prompt_logprobs(prompt_of(session), weights=gone)
    assert_unchanged(session, bits, digest)
    assert draw(session) == live


def test_weights_that_do_not_fit_are_refused_before_anything_changes(
    llama_config, session: TrainingSession, tmp_path: Path
) -> None:
    # An adapter of another rank: another LoRA setting, or no LoRA session at all.
    other_lora = LoraSettings(r=2, alpha=8, dropout=0.0)
    other = TrainingSession(llama_config(lora=other_lora, lr_scheduler="constant"), device="cpu")
    other.export_weights(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    train_a_step(session)
    bits, digest = live_bits(session), session.state_digest()
    for source in (tmp_path / "other", tmp_path / "empty"):
        with pytest.raises((InvalidArgument, FailedPrecondition)):
            session.sample(prompt_of(session), weights=source, **OPTIONS)
    with pytest.raises(InvalidArgument, match="max_tokens"):  # the request before the source
        session.sample(prompt_of(session), weights=tmp_path / "gone", max_tokens=0)
    for weights in ("", 3, SampleWeights):
        with pytest.raises(InvalidArgument, match="weights must be"):
            session.sample(prompt_of(session), weights=weights, **OPTIONS)
    with pytest.raises(InvalidArgument, match="not both"):
        SampleWeights(export=tmp_path / "other", base_model=True)
    with pytest.raises(InvalidArgument, match="prompt_tokens is empty"):
        session.prompt_logprobs([], weights=BASE_MODEL)
    assert_unchanged(session, bits, digest)


def test_a_failure_while_sampling_other_weights_still_puts_the_live_bits_back(
    session: TrainingSession, tmp_path: Path, monkeypatch
) -> None:
    session.export_weights(tmp_path / "snapshot")
    train_a_step(session)
    bits, digest, live = live_bits(session), session.state_digest(), draw(session)

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure while sampling")

    monkeypatch.setattr(session.sampler, "sample", fail)
    for weights in (tmp_path / "snapshot", BASE_MODEL):
        with pytest.raises(RuntimeError, match="injected failure while sampling"):
            session.sample(prompt_of(session), weights=weights, **OPTIONS)
    monkeypatch.undo()
    assert_unchanged(session, bits, digest)
    assert draw(session) == live


def test_failing_to_put_the_live_weights_back_breaks_the_session(
    session: TrainingSession, tmp_path: Path, monkeypatch
) -> None:
    session.export_weights(tmp_path / "snapshot")
    train_a_step(session)

    def fail(pairs):
        raise RuntimeError("injected failure while restoring")

    monkeypatch.setattr(session_sampling, "copy_into", fail)
    with pytest.raises(RuntimeError, match="injected failure while restoring"):
        session.sample(prompt_of(session), weights=tmp_path / "snapshot", **OPTIONS)
    assert "putting the live weights back" in session.broken
    with pytest.raises(FailedPrecondition, match="unusable"):
        session.sample(prompt_of(session), **OPTIONS)
    with pytest.raises(FailedPrecondition, match="unusable"):
        train_a_step(session)


def test_sampling_needs_a_causal_lm_session(llama_classifier_config) -> None:
    session = TrainingSession(llama_classifier_config(), device="cpu")
    with pytest.raises(InvalidArgument, match="sampling needs a causal-lm session"):
        session.prompt_logprobs([1, 2, 3], weights=BASE_MODEL)
