"""The token-level losses as plain functions: values, gradients and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from trainwire.contract.tokens import TokenExample, is_token_batch
from trainwire.server.engine.loss.losses import LOSSES, TokenInputs, require_inputs, resolve_loss
from trainwire.server.errors import InvalidArgument


def _inputs(n: int = 64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=generator) * 3
    q = logp + (torch.rand(n, generator=generator) - 0.5) * 0.8  # ratios on both sides of 1
    advantages = torch.randn(n, generator=generator)
    weights = torch.randn(n, generator=generator)
    mask = (torch.rand(n, generator=generator) > 0.3).float()
    mask[0] = 1.0  # a sequence ratio covers at least one token
    return logp, TokenInputs(
        weights=weights, logprobs=q, advantages=advantages, sequence_ratio_mask=mask
    )


def _run(name: str, logp: torch.Tensor, inputs: TokenInputs, config=None):
    spec, resolved = resolve_loss(name, config)
    logp = logp.clone().requires_grad_(True)
    out = spec.fn(logp, inputs, resolved)
    out.loss.backward()
    return out, logp.grad


def _formula(name: str, logp: list[float], inputs: TokenInputs, config) -> float:
    """DESIGN's formulas, term by term in float64 Python."""
    w, q, a = (t.tolist() for t in (inputs.weights, inputs.logprobs, inputs.advantages))
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    beta = config.get("beta", 0.05)
    marked = [lp - qi for lp, qi, m in zip(logp, q, inputs.sequence_ratio_mask, strict=True) if m]
    sequence_ratio = math.exp(math.fsum(marked) / len(marked))  # one example: one sequence
    terms = []
    for lp, wi, qi, ai in zip(logp, w, q, a, strict=True):
        r = sequence_ratio if name == "gspo" else math.exp(lp - qi)
        clipped = min(max(r, lo), hi)
        if name == "cross_entropy":
            terms.append(-wi * lp)
        elif name == "importance_sampling":
            terms.append(-r * ai)
        elif name in ("ppo", "gspo"):
            terms.append(-min(r * ai, clipped * ai))
        elif name == "cispo":
            terms.append(-clipped * lp * ai)
        else:
            terms.append(-(lp * ai - beta / 2 * (lp - qi) ** 2))
    return math.fsum(terms)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize(
    "config", [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"beta": 0.3}]
)
def test_each_loss_equals_its_formula(name, config):
    spec, _ = resolve_loss(name, None)
    config = {key: value for key, value in config.items() if key in spec.defaults}
    logp, inputs = _inputs()
    out, _ = _run(name, logp, inputs, config)
    expected = _formula(name, logp.tolist(), inputs, config)
    # fp32 tensors against a float64 sum: the two orders of rounding differ in the last bits.
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert out.metrics["loss:sum"] == float(out.loss.detach())


def test_on_policy_importance_sampling_has_the_advantage_weighted_cross_entropy_gradient():
    logp, inputs = _inputs()
    on_policy = TokenInputs(logprobs=logp.clone(), advantages=inputs.advantages)
    out, grad_is = _run("importance_sampling", logp, on_policy)
    _, grad_ce = _run("cross_entropy", logp, TokenInputs(weights=inputs.advantages))
    assert torch.equal(grad_is, grad_ce)
    assert float(out.loss.detach()) == float(-inputs.advantages.sum())
    assert out.metrics["ratio:mean"] == 1.0


def test_ppo_gradient_vanishes_where_the_clipped_term_wins():
    logp, inputs = _inputs()
    _, grad = _run("ppo", logp, inputs)
    ratio = torch.exp(logp - inputs.logprobs)
    a = inputs.advantages
    clipped_wins = ((ratio > 1.2) & (a > 0)) | ((ratio < 0.8) & (a < 0))
    assert clipped_wins.any() and (~clipped_wins).any()
    assert torch.all(grad[clipped_wins] == 0)
    assert torch.equal(grad[~clipped_wins], (-ratio * a)[~clipped_wins])


def test_cispo_gradient_is_the_detached_clipped_ratio_times_the_advantage():
    logp, inputs = _inputs()
    out, grad = _run("cispo", logp, inputs)
    ratio = torch.exp(logp - inputs.logprobs)
    assert torch.equal(grad, -(torch.clamp(ratio, 0.8, 1.2) * inputs.advantages))
    clipped = ((ratio < 0.8) | (ratio > 1.2)).float().mean()
    assert out.metrics["clip_fraction:mean"] == float(clipped)


def test_dro_gradient_pulls_toward_the_sampling_policy():
    logp, inputs = _inputs()
    _, grad = _run("dro", logp, inputs, {"beta": 0.5})
    expected = -(inputs.advantages - 0.5 / 2 * 2 * (logp - inputs.logprobs))
    assert torch.allclose(grad, expected, rtol=0, atol=1e-6)  # two fp32 expression orders


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("mse", None, "unknown loss_fn 'mse'"),
        ("ppo", {"clip_epsilon": 0.2}, "unknown key.*clip_epsilon.*ppo takes"),
        ("importance_sampling", {"beta": 0.1}, "importance_sampling takes no keys"),
        ("ppo", {"clip_low_threshold": float("nan")}, "finite number"),
        ("ppo", {"clip_low_threshold": "0.8"}, "finite number"),
        ("cispo", {"clip_low_threshold": 1.5}, "clip_low_threshold <= clip_high_threshold"),
    ],
)
def test_bad_loss_settings_are_refused_before_any_work(name, config, message):
    with pytest.raises(InvalidArgument, match=message):
        resolve_loss(name, config)


def test_a_ratio_loss_refuses_examples_without_its_inputs():
    spec, _ = resolve_loss("ppo", None)
    examples = [TokenExample([1], [2], logprobs=[-1.0], advantages=[1.0]), TokenExample([1], [2])]
    with pytest.raises(InvalidArgument, match="ppo needs logprobs on every example; example 1"):
        require_inputs("ppo", spec, examples)
    require_inputs("cross_entropy", resolve_loss("cross_entropy", None)[0], examples)


def test_token_examples_validate_at_construction():
    assert TokenExample([1, 2], [2, 3], weights=[1, 0]).weights == (1.0, 0.0)
    with pytest.raises(ValueError, match="advantages has 1 values but tokens has 2"):
        TokenExample([1, 2], [2, 3], advantages=[1.0])
    with pytest.raises(ValueError, match="tokens is empty"):
        TokenExample([], [])
    with pytest.raises(ValueError, match=r"logprobs\[1\] is inf"):
        TokenExample([1, 2], [2, 3], logprobs=[0.0, float("inf")])
    with pytest.raises(ValueError, match="mixes token examples and text examples"):
        from trainwire.client import InputExample

        is_token_batch([TokenExample([1], [2]), InputExample("hi")])


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_is_the_sum_of_its_per_token_terms_and_the_sdk_front_reports_them(name):
    from types import SimpleNamespace

    from trainwire.server.service.loss_terms import elementwise_loss

    logp, inputs = _inputs(n=12)
    out, _ = _run(name, logp, inputs)
    assert out.elementwise.shape == logp.shape
    assert torch.equal(out.elementwise.sum(), out.loss.detach())
    example = TokenExample(
        [1] * 12,
        [2] * 12,
        weights=inputs.weights.tolist(),
        logprobs=inputs.logprobs.tolist(),
        advantages=inputs.advantages.tolist(),
        sequence_ratio_mask=inputs.sequence_ratio_mask.tolist(),
    )
    (row,) = elementwise_loss(name, {}, [example], SimpleNamespace(logprobs=[logp.tolist()]))
    assert row == out.elementwise.tolist()


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_sdk_fronts_terms_of_a_batch_are_the_engines_own_split_by_example(name):
    """A batch of examples of unequal lengths: each row the front reports is that example's
    slice of the terms the engine computes over the whole batch (flat, with the lengths), bit
    for bit."""
    from types import SimpleNamespace

    from trainwire.server.service.loss_terms import elementwise_loss

    lengths = (5, 1, 17, 9)
    logp, inputs = _inputs(n=sum(lengths), seed=3)
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    inputs.sequence_ratio_mask[starts] = 1.0  # each example's sequence ratio covers a token
    spec, resolved = resolve_loss(name, {})
    engine = spec.fn(logp, TokenInputs(**{**vars(inputs), "lengths": lengths}), resolved)

    def part(values: torch.Tensor) -> list[list[float]]:
        return [row.tolist() for row in values.split(lengths)]

    fields = ("weights", "logprobs", "advantages", "sequence_ratio_mask")
    columns = [part(getattr(inputs, field)) for field in fields]
    examples = [
        TokenExample([1] * n, [2] * n, **dict(zip(fields, values, strict=True)))
        for n, *values in zip(lengths, *columns, strict=True)
    ]
    reported = elementwise_loss(name, {}, examples, SimpleNamespace(logprobs=part(logp)))
    assert reported == part(engine.elementwise)
