"""Token-level training in the engine: logprobs, the five losses, accumulation, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from fresh_state import fresh_digest
from transformers import AutoModelForCausalLM

from trainwire.client import InputExample, LoraSettings
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.testing import tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
SETUPS = {"full": None, "lora": NO_DROPOUT_LORA}


@pytest.fixture(params=list(SETUPS))
def session_factory(request, llama_config):
    lora = SETUPS[request.param]

    def make(**overrides) -> TrainingSession:
        config = llama_config(lora=lora, lr_scheduler="constant", **overrides)
        return TrainingSession(config, device="cpu")

    return make


def test_forward_logprobs_are_a_plain_transformers_forward_and_change_nothing(
    llama_config, tiny_llama
):
    session = TrainingSession(llama_config(), device="cpu")
    before = fresh_digest(session)
    examples = tiny_token_examples()
    out = session.forward(examples)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    for example, logprobs in zip(examples, out.logprobs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([example.tokens])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[range(len(example)), list(example.target_tokens)]
        # A padded batch against one unpadded row, log_softmax against gather - logsumexp.
        assert torch.allclose(torch.tensor(logprobs), expected, rtol=0, atol=1e-5)
        assert len(logprobs) == len(example)
    assert fresh_digest(session) == before
    assert out.metrics["loss:sum"] == out.loss


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_each_loss_is_its_formula_over_the_returned_logprobs(session_factory, loss_fn):
    session = session_factory()
    examples = tiny_token_examples(seed=1)
    config = {"ppo": {"clip_low_threshold": 0.7}, "dro": {"beta": 0.2}}.get(loss_fn)
    out = session.forward_backward(examples, loss_fn=loss_fn, loss_fn_config=config)
    lo, hi, beta = (
        (config or {}).get("clip_low_threshold", 0.8),
        1.2,
        (config or {}).get("beta", 0.05),
    )
    terms = []
    for example, logprobs in zip(examples, out.logprobs, strict=True):
        for lp, w, q, a in zip(
            logprobs, example.weights, example.logprobs, example.advantages, strict=True
        ):
            r = math.exp(lp - q)
            terms.append(
                {
                    "cross_entropy": -w * lp,
                    "importance_sampling": -r * a,
                    "ppo": -min(r * a, min(max(r, lo), hi) * a),
                    "cispo": -min(max(r, lo), hi) * lp * a,
                    "dro": -(lp * a - beta / 2 * (lp - q) ** 2),
                }[loss_fn]
            )
    # The engine sums fp32 terms; this sums float64 ones: equal to the last few bits.
    assert out.loss == pytest.approx(math.fsum(terms), rel=1e-5, abs=1e-4)
    assert out.metrics["loss:sum"] == out.loss
    if loss_fn != "cross_entropy":
        assert "ratio:mean" in out.metrics
    if loss_fn in ("ppo", "cispo"):
        assert 0.0 <= out.metrics["clip_fraction:mean"] <= 1.0
    assert session.accumulated == 1


def test_on_policy_importance_sampling_is_cross_entropy_weighted_by_the_advantages(
    session_factory,
):
    examples = tiny_token_examples(seed=2)
    policy = session_factory()
    q = policy.forward(examples).logprobs
    on_policy = [
        TokenExample(e.tokens, e.target_tokens, logprobs=lp, advantages=e.advantages)
        for e, lp in zip(examples, q, strict=True)
    ]
    out = policy.forward_backward(on_policy, loss_fn="importance_sampling")
    assert out.logprobs == q
    assert out.metrics["ratio:mean"] == 1.0
    policy.optim_step()

    weighted = session_factory()
    as_weights = [TokenExample(e.tokens, e.target_tokens, weights=e.advantages) for e in examples]
    weighted.forward_backward(as_weights)
    weighted.optim_step()
    assert policy.state_digest() == weighted.state_digest()


def test_token_microbatches_accumulate_between_text_ones_and_resume_exactly(
    session_factory, tmp_path
):
    text = [InputExample("the movie was great"), InputExample("a dull film")]
    tokens = tiny_token_examples(seed=3)

    def run(session: TrainingSession, *, checkpoint=None, resume=None) -> str:
        if resume is None:
            session.forward_backward(text)
            session.forward_backward(tokens[:2], loss_fn="ppo")
            if checkpoint is not None:
                session.save_state(checkpoint)
        else:
            session.load_state(resume)
        session.forward_backward(tokens[2:], loss_fn="importance_sampling")
        step = session.optim_step()
        assert step.step == 1
        return session.state_digest()

    uninterrupted = run(session_factory())
    assert run(session_factory(), checkpoint=tmp_path / "mid") == uninterrupted
    assert run(session_factory(), resume=tmp_path / "mid") == uninterrupted


def test_a_learning_rate_given_to_optim_step_replaces_the_schedule_for_that_update(
    llama_config,
):
    session = TrainingSession(llama_config(warmup_steps=10), max_steps=20, device="cpu")
    session.forward_backward(tiny_token_examples(seed=4))
    assert session.optim_step(learning_rate=0.25).learning_rate == 0.25
    session.forward_backward(tiny_token_examples(seed=5))
    assert session.optim_step().learning_rate == pytest.approx(1e-3 * 1 / 10)
    before = fresh_digest(session)
    session.forward_backward(tiny_token_examples(seed=6))
    middle = fresh_digest(session)
    for bad in (-1.0, float("nan"), "0.1", True):
        with pytest.raises(InvalidArgument, match="learning_rate"):
            session.optim_step(learning_rate=bad)
    assert fresh_digest(session) == middle != before


def test_a_custom_weighting_equals_the_builtin_cross_entropy(llama_config):
    """The same gradient reached two ways: weights computed by the caller from a loss over
    logprobs (what ``forward_backward_custom`` sends) and the loss built in."""
    examples = tiny_token_examples(seed=7)
    builtin = TrainingSession(llama_config(), device="cpu")
    builtin.forward_backward(examples)

    custom = TrainingSession(llama_config(), device="cpu")
    logprobs = [torch.tensor(lp, requires_grad=True) for lp in custom.forward(examples).logprobs]
    loss = -sum(
        (torch.tensor(e.weights) * lp).sum() for e, lp in zip(examples, logprobs, strict=True)
    )
    loss.backward()
    reweighted = [
        TokenExample(e.tokens, e.target_tokens, weights=(-lp.grad).tolist())
        for e, lp in zip(examples, logprobs, strict=True)
    ]
    custom.forward_backward(reweighted)
    assert custom.state_digest() == builtin.state_digest()


@pytest.mark.parametrize(
    ("examples", "kwargs", "message"),
    [
        (lambda: tiny_token_examples(), {"loss_fn": "mse"}, "unknown loss_fn 'mse'"),
        (
            lambda: tiny_token_examples(),
            {"loss_fn_config": {"beta": 1.0}},
            "cross_entropy takes no",
        ),
        (
            lambda: [TokenExample([5, 6], [6, 7])],
            {"loss_fn": "ppo"},
            "ppo needs logprobs on every example; example 0",
        ),
        (lambda: [TokenExample([5, 6], [6, 9999])], {}, r"target_tokens\[1\] = 9999 is outside"),
        (lambda: [TokenExample([5] * 65, [6] * 65)], {}, "65 tokens is over max_length 64"),
        (lambda: [InputExample("hello")], {"loss_fn": "ppo"}, "need token examples"),
        (lambda: [], {}, "empty batch"),
        (
            lambda: [TokenExample([5], [6]), InputExample("hi")],
            {},
            "mixes token examples and text",
        ),
    ],
)
def test_bad_token_batches_are_refused_and_change_nothing(llama_config, examples, kwargs, message):
    session = TrainingSession(llama_config(), device="cpu")
    session.forward_backward(tiny_token_examples(seed=8))
    before = fresh_digest(session)
    for call in (session.forward, session.forward_backward):
        with pytest.raises(InvalidArgument, match=message):
            call(examples(), **kwargs)
    assert fresh_digest(session) == before
    assert session.accumulated == 1


def test_token_examples_need_a_causal_lm_session(bert_classifier_config):
    session = TrainingSession(bert_classifier_config(), device="cpu")
    with pytest.raises(InvalidArgument, match="token examples need a causal-lm session"):
        session.forward_backward([TokenExample([5], [6])])
