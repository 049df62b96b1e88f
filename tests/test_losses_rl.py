"""gspo, the sequence-ratio loss: its formula, its per-token ``sequence_ratio_mask`` input from the
client to the loss (the wire, the payload digest, the Tinker front), and its refusals."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
import tinker
import torch
from fresh_state import fresh_digest, fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server
from tinker import types
from tinker_loops import lora_training

from trainwire.client import LoraSettings, SessionClient, TokenExample
from trainwire.contract.codec import token_examples_from_proto, token_examples_to_proto
from trainwire.server.engine.loss.losses import TokenInputs, resolve_loss
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.server.process import ServerHandle
from trainwire.testing import tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}


def masked(examples: list[TokenExample], prompt: int = 2) -> list[TokenExample]:
    """``examples`` with a sequence ratio over every target after the first ``prompt`` (none
    when ``prompt`` covers them all)."""
    return [
        TokenExample(
            e.tokens,
            e.target_tokens,
            weights=e.weights,
            logprobs=e.logprobs,
            advantages=e.advantages,
            sequence_ratio_mask=[0.0] * min(prompt, len(e)) + [1.0] * max(len(e) - prompt, 0),
        )
        for e in examples
    ]


def gspo_by_hand(examples, logprobs, low=0.8, high=1.2) -> tuple[float, list[float]]:
    """Tinker's GSPO in float64 Python: per example, the mean log-ratio over its masked targets
    is the value of every one of its tokens' ratio; each term is PPO's with that ratio."""
    terms, ratios = [], []
    for example, row in zip(examples, logprobs, strict=True):
        marked = [
            lp - q
            for lp, q, m in zip(row, example.logprobs, example.sequence_ratio_mask, strict=True)
            if m != 0
        ]
        ratio = math.exp(math.fsum(marked) / len(marked))
        for a in example.advantages:
            terms.append(-min(ratio * a, min(max(ratio, low), high) * a))
            ratios.append(ratio)
    return math.fsum(terms), ratios


@pytest.fixture
def config(llama_config):
    return llama_config(lora=NO_DROPOUT_LORA, lr_scheduler="constant")


@pytest.mark.parametrize("loss_config", [None, CLIP])
def test_gspo_is_its_formula_over_the_returned_logprobs(config, loss_config):
    session = TrainingSession(config, device="cpu")
    examples = masked(tiny_token_examples(3, seed=4))
    out = session.forward_backward(examples, loss_fn="gspo", loss_fn_config=loss_config)
    low, high = (loss_config or {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).values()
    expected, ratios = gspo_by_hand(examples, out.logprobs, low, high)
    # The engine sums fp32 terms; this sums float64 ones: equal to the last few bits.
    assert out.loss == pytest.approx(expected, rel=1e-5, abs=1e-4)
    assert out.metrics["loss:sum"] == out.loss
    assert out.metrics["ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    assert out.metrics["ratio:max"] == pytest.approx(max(ratios), rel=1e-5)
    assert 0.0 <= out.metrics["clip_fraction:mean"] <= 1.0


def test_each_gspo_token_has_its_own_gradient_scaled_by_the_sequence_ratio():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.2])
    inputs = TokenInputs(
        logprobs=torch.tensor([-1.1, -1.9, -0.6, -2.5, -1.0, -0.4]),
        advantages=torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -1.0]),
        sequence_ratio_mask=torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
        lengths=(3, 3),
    )
    spec, resolved = resolve_loss("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2})
    grad_logp = logp.clone().requires_grad_(True)
    out = spec.fn(grad_logp, inputs, resolved)
    out.loss.backward()
    # Example 0's ratio is exp(mean(-0.1, 0.1)) over its two masked targets, example 1's
    # exp(mean(-0.5, -0.5)): both inside the clip range, so every term is -s * A and its
    # gradient -s * A too (the ratio's value is detached, its own logp's gradient is not).
    first, second = math.exp((-0.1 + 0.1) / 2), math.exp(-0.5)
    ratios = torch.tensor([first] * 3 + [second] * 3)
    assert torch.allclose(out.elementwise, -ratios * inputs.advantages, rtol=1e-6, atol=0)
    assert torch.allclose(grad_logp.grad, -ratios * inputs.advantages, rtol=1e-6, atol=0)


def test_gspo_gradient_vanishes_where_the_clipped_ratio_wins():
    logp = torch.tensor([-1.0, -1.0])
    inputs = TokenInputs(
        logprobs=torch.tensor([-2.0, -2.0]),  # the sequence ratio is e, past 1.2
        advantages=torch.tensor([1.0, -1.0]),
        sequence_ratio_mask=torch.tensor([1.0, 1.0]),
    )
    spec, resolved = resolve_loss("gspo", None)
    grad_logp = logp.clone().requires_grad_(True)
    out = spec.fn(grad_logp, inputs, resolved)
    out.loss.backward()
    # A > 0 takes the clipped 1.2 (no gradient); A < 0 keeps the larger ratio (gradient e).
    assert out.elementwise.tolist() == pytest.approx([-1.2, math.e])
    assert grad_logp.grad.tolist() == pytest.approx([0.0, math.e])
    assert out.metrics["clip_fraction:mean"] == 1.0


@pytest.mark.parametrize(
    ("examples", "loss_config", "message"),
    [
        (tiny_token_examples(2), None, "gspo needs sequence_ratio_mask on every example"),
        (masked(tiny_token_examples(2), prompt=99), None, "example 0's sequence_ratio_mask marks"),
        (masked(tiny_token_examples(2)), {"beta": 0.1}, "unknown key.*beta.*gspo takes"),
        (masked(tiny_token_examples(2)), {"clip_low_threshold": 2.0}, "clip_low_threshold <="),
    ],
)
def test_bad_gspo_requests_are_refused_and_change_nothing(config, examples, loss_config, message):
    session = TrainingSession(config, device="cpu")
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=message):
        session.forward_backward(examples, loss_fn="gspo", loss_fn_config=loss_config)
    assert fresh_digest(session) == before


def test_stable_reinforce_is_refused_with_what_to_use_instead(config):
    session = TrainingSession(config, device="cpu")
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=r"stable_reinforce is not.*ppo, cispo or gspo"):
        session.forward_backward(tiny_token_examples(2), loss_fn="stable_reinforce")
    assert fresh_digest(session) == before


def test_a_sequence_ratio_mask_is_checked_at_construction_and_survives_the_wire():
    with pytest.raises(ValueError, match="sequence_ratio_mask has 1 values but tokens has 2"):
        TokenExample([1, 2], [2, 3], sequence_ratio_mask=[1.0])
    with pytest.raises(ValueError, match=r"sequence_ratio_mask\[0\] is nan"):
        TokenExample([1], [2], sequence_ratio_mask=[float("nan")])
    examples = masked(tiny_token_examples(2)) + tiny_token_examples(1)
    decoded = token_examples_from_proto(token_examples_to_proto(examples))
    # The other inputs travel as float32; a mask's 0.0 and 1.0 are exact there.
    assert [e.sequence_ratio_mask for e in decoded] == [e.sequence_ratio_mask for e in examples]
    assert "sequence_ratio_mask" in examples[0].to_dict()  # in the payload digest
    assert "sequence_ratio_mask" not in examples[2].to_dict()  # older payloads keep theirs


@pytest.fixture
def served(tmp_path, model_root, config):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("gspo", config)
        yield handle, client
        client.close_channel()


def test_gspo_remote_equals_in_process_bit_for_bit_and_its_mask_is_in_the_payload(
    served: tuple[ServerHandle, SessionClient], config
):
    handle, remote = served
    local = TrainingSession(config, device="cpu")
    for index, loss_config in enumerate((None, CLIP)):
        batch = masked(tiny_token_examples(3, seed=index), prompt=index + 1)
        got = remote.forward_backward(
            batch, operation_key=f"fb/{index}", loss_fn="gspo", loss_fn_config=loss_config
        )
        want = local.forward_backward(batch, loss_fn="gspo", loss_fn_config=loss_config)
        assert (got.loss, [list(row) for row in got.logprobs], got.metrics) == (
            want.loss,
            want.logprobs,
            want.metrics,
        )
        remote.optim_step(operation_key=f"step/{index}")
        local.optim_step()
    assert remote.info().state_digest == local.state_digest()
    state = fresh_server_info(handle)
    # The same key again with the same mask is answered from the journal; with another mask it
    # is another payload.
    batch = masked(tiny_token_examples(3, seed=1), prompt=2)
    again = remote.forward_backward(
        batch, operation_key="fb/1", loss_fn="gspo", loss_fn_config=CLIP
    )
    assert again.loss == got.loss
    with pytest.raises(grpc.RpcError) as reused:
        remote.forward_backward(
            masked(tiny_token_examples(3, seed=1), prompt=3),
            operation_key="fb/1",
            loss_fn="gspo",
            loss_fn_config=CLIP,
        )
    assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as refused:
        remote.forward_backward(tiny_token_examples(2), operation_key="fb/9", loss_fn="gspo")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "gspo needs sequence_ratio_mask" in refused.value.details()
    assert fresh_server_info(handle) == state


def test_the_sdks_forward_backward_with_gspo_trains_and_reports_its_metrics(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        training, tokenizer = run.training, run.tokenizer
        prompt = tokenizer.encode("the cat")
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=2)
        result = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
        data, examples = [], []
        for index, seq in enumerate(result.sequences):
            full, skip = prompt + list(seq.tokens), len(prompt) - 1
            inputs = {
                "target_tokens": full[1:],
                "logprobs": [0.0] * skip + list(seq.logprobs),
                "advantages": [0.0] * skip + [1.0 - 2 * index] * len(seq.tokens),
                "sequence_ratio_mask": [0.0] * skip + [1.0] * len(seq.tokens),
            }
            data.append(types.Datum(types.ModelInput.from_ints(full[:-1]), inputs))
            examples.append(TokenExample(full[:-1], **inputs))
        out = training.forward_backward(data, "gspo", CLIP).result(timeout=60)
        logprobs = [row["logprobs"].tolist() for row in out.loss_fn_outputs]
        expected, _ = gspo_by_hand(examples, logprobs, 0.9, 1.05)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert {"loss:sum", "ratio:mean", "ratio:max", "clip_fraction:mean"} <= set(out.metrics)
        terms = [sum(row["elementwise_loss"].tolist()) for row in out.loss_fn_outputs]
        assert sum(terms) == pytest.approx(out.metrics["loss:sum"], rel=1e-5, abs=1e-5)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        state = fresh_server_info(run.handle)
        with pytest.raises(tinker.RequestFailedError, match=r"unknown key\(s\) epsilon; gspo"):
            training.forward_backward(data, "gspo", {"epsilon": 0.2}).result(timeout=60)
        assert fresh_server_info(run.handle) == state
