"""Sampling from the live weights: deterministic, read-only, and scored by the trainer itself."""

from __future__ import annotations

import pytest
import torch
from fresh_state import fresh_digest
from transformers import AutoModelForCausalLM

from trainwire.client import InputExample, LoraSettings, TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.testing import tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)


@pytest.fixture(params=["full", "lora"])
def session(request, llama_config) -> TrainingSession:
    lora = NO_DROPOUT_LORA if request.param == "lora" else None
    return TrainingSession(llama_config(lora=lora, lr_scheduler="constant"), device="cpu")


def prompt_of(session: TrainingSession, text: str = "the movie was") -> list[int]:
    return session.tokenize([text])[0]


def test_the_same_seed_gives_the_same_samples_and_changes_nothing(session):
    prompt = prompt_of(session)
    before = fresh_digest(session)
    options = {"max_tokens": 10, "num_samples": 4, "temperature": 1.0, "top_p": 0.95}
    first = session.sample(prompt, seed=1, **options)
    assert session.sample(prompt, seed=1, **options) == first
    assert session.sample(prompt, seed=2, **options) != first
    assert len({s.tokens for s in first}) > 1  # the rows of one request draw independently
    assert fresh_digest(session) == before


def test_sampling_between_training_steps_leaves_every_training_bit_alone(llama_config):
    config = llama_config(lora=LoraSettings(r=4, alpha=8, dropout=0.1), lr_scheduler="constant")
    plain, sampled = (TrainingSession(config, device="cpu") for _ in range(2))
    for step in range(2):
        batch = tiny_token_examples(2, seed=step)
        for session in (plain, sampled):
            session.forward_backward(batch)
        sampled.sample(prompt_of(sampled), max_tokens=6, num_samples=2, seed=step)
        for session in (plain, sampled):
            session.optim_step()
    # Dropout draws from the training RNG at every step: a sampler that touched it would show.
    assert sampled.state_digest() == plain.state_digest()


def test_greedy_sampling_is_a_plain_transformers_greedy_decode(llama_config, tmp_path):
    session = TrainingSession(llama_config(lr_scheduler="constant"), device="cpu")
    session.forward_backward([InputExample("the movie was great, truly great")])
    session.optim_step()
    session.export_weights(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    prompt = prompt_of(session)
    (greedy,) = session.sample(prompt, max_tokens=12, temperature=0)
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert list(greedy.tokens) == reference[: len(greedy.tokens)]
    if greedy.stop_reason == "length":
        assert len(greedy.tokens) == 12


def test_a_sample_has_the_logprobs_forward_gives_it_and_an_on_policy_ratio_of_exactly_one(session):
    prompt = prompt_of(session)
    for sample in session.sample(prompt, max_tokens=10, num_samples=3, seed=3, temperature=1.3):
        full = [*prompt, *sample.tokens]
        alone = TokenExample(full[:-1], full[1:])
        logprobs = session.forward([alone]).logprobs[0]
        assert tuple(logprobs[len(prompt) - 1 :]) == sample.logprobs
        advantages = [0.0] * (len(prompt) - 1) + [0.5 + i for i in range(len(sample.tokens))]
        on_policy = TokenExample(
            alone.tokens,
            alone.target_tokens,
            logprobs=[*logprobs[: len(prompt) - 1], *sample.logprobs],
            advantages=advantages,
        )
        before = fresh_digest(session)
        out = session.forward(  # forward: the same number without changing the session
            [on_policy], loss_fn="importance_sampling"
        )
        assert out.loss == -sum(torch.tensor(advantages, dtype=torch.float32).tolist())
        assert out.metrics["ratio:mean"] == 1.0
        assert fresh_digest(session) == before


def test_on_policy_importance_sampling_through_forward_backward_is_minus_the_advantages(session):
    prompt = prompt_of(session)
    (sample,) = session.sample(prompt, max_tokens=8, seed=4)
    full = [*prompt, *sample.tokens]
    n = len(full) - 1
    weights_after_prompt = [0.0] * (len(prompt) - 1) + [1.0] * len(sample.tokens)
    forward = session.forward([TokenExample(full[:-1], full[1:])]).logprobs[0]
    example = TokenExample(
        full[:-1], full[1:], logprobs=forward, advantages=[0.25 * w for w in weights_after_prompt]
    )
    out = session.forward_backward([example], loss_fn="importance_sampling")
    assert len(out.logprobs[0]) == n
    assert out.loss == float(-torch.tensor(example.advantages, dtype=torch.float32).sum())


def test_stop_tokens_and_max_tokens_end_samples_with_their_reason(session):
    prompt = prompt_of(session)
    (free,) = session.sample(prompt, max_tokens=6, temperature=0)
    assert free.stop_reason == "length" and len(free.tokens) == 6
    stop = free.tokens[2]
    (stopped,) = session.sample(prompt, max_tokens=6, temperature=0, stop_tokens=[stop])
    first = free.tokens.index(stop)
    assert stopped.stop_reason == "stop"
    assert stopped.tokens == free.tokens[: first + 1]  # the stop token is kept
    # The logprobs are the forward of this sample alone (the contract), not the longer sample's
    # prefix: a forward over fewer positions may round otherwise in its last bits on some CPUs.
    example = TokenExample.from_sequence([*prompt, *stopped.tokens])
    assert list(stopped.logprobs) == session.forward([example]).logprobs[0][-len(stopped.tokens) :]


def test_a_lora_session_samples_from_the_adapted_model(llama_config):
    session = TrainingSession(
        llama_config(lora=NO_DROPOUT_LORA, lr_scheduler="constant", learning_rate=0.05),
        device="cpu",
    )
    prompt = prompt_of(session)
    before = session.sample(prompt, max_tokens=8, num_samples=2, seed=5)
    for _ in range(3):
        session.forward_backward([InputExample("the movie was wonderful wonderful wonderful")])
        session.optim_step()
    after = session.sample(prompt, max_tokens=8, num_samples=2, seed=5)
    assert [s.logprobs for s in after] != [s.logprobs for s in before]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be in"),
        ({"max_tokens": 10**6}, "max_tokens must be in"),
        ({"max_tokens": 4, "num_samples": 0}, "num_samples must be in"),
        ({"max_tokens": 4, "num_samples": 1000}, "num_samples must be in"),
        ({"max_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p must be in"),
        ({"max_tokens": 4, "top_k": -1}, "top_k must be >= 0"),
        ({"max_tokens": 4, "stop_tokens": [10**7]}, "stop_tokens must be ids"),
        ({"max_tokens": 4, "seed": -1}, "seed must be"),
    ],
)
def test_bad_sampling_arguments_are_refused_and_change_nothing(session, options, message):
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=message):
        session.sample(prompt_of(session), **options)
    assert fresh_digest(session) == before


def test_sampling_needs_a_causal_lm_session(bert_classifier_config):
    session = TrainingSession(bert_classifier_config(), device="cpu")
    with pytest.raises(InvalidArgument, match="sampling needs a causal-lm session"):
        session.sample([5, 6], max_tokens=3)
