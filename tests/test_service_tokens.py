"""Token-level training, sampling and tokenization through a real server on loopback."""

from __future__ import annotations

import grpc
import pytest
from fresh_state import fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import LoraSettings, SessionClient, TokenExample, forward_backward_custom
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_token_examples

NO_DROPOUT_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
LOSSES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
    ("cispo", None),
    ("dro", {"beta": 0.1}),
]


@pytest.fixture(params=["full", "lora"])
def config(request, llama_config):
    lora = NO_DROPOUT_LORA if request.param == "lora" else None
    return llama_config(lora=lora, lr_scheduler="constant")


@pytest.fixture
def remote(tmp_path, model_root, config):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle)
        client.open("tokens", config)
        yield client
        client.close_channel()


def test_every_loss_remote_equals_in_process_bit_for_bit(remote: SessionClient, config):
    local = TrainingSession(config, device="cpu")
    for index, (loss_fn, loss_config) in enumerate(LOSSES):
        batch = tiny_token_examples(3, seed=index)
        got = remote.forward_backward(
            batch, operation_key=f"fb/{index}", loss_fn=loss_fn, loss_fn_config=loss_config
        )
        want = local.forward_backward(batch, loss_fn=loss_fn, loss_fn_config=loss_config)
        assert (got.loss, [list(row) for row in got.logprobs], got.metrics) == (
            want.loss,
            want.logprobs,
            want.metrics,
        )
        step = remote.optim_step(operation_key=f"step/{index}", learning_rate=1e-3 * (index + 1))
        assert (
            step.learning_rate == local.optim_step(learning_rate=1e-3 * (index + 1)).learning_rate
        )
    assert remote.info().state_digest == local.state_digest()
    forward = remote.forward(tiny_token_examples(2, seed=9), loss_fn="ppo")
    assert [list(row) for row in forward.logprobs] == local.forward(
        tiny_token_examples(2, seed=9), loss_fn="ppo"
    ).logprobs


def test_a_retried_key_returns_the_recorded_logprobs_and_another_loss_is_refused(
    remote: SessionClient,
):
    batch = tiny_token_examples(2, seed=1)
    first = remote.forward_backward(batch, operation_key="k", loss_fn="importance_sampling")
    again = remote.forward_backward(batch, operation_key="k", loss_fn="importance_sampling")
    assert again.replayed and not first.replayed
    assert (again.loss, again.logprobs, again.metrics) == (
        first.loss,
        first.logprobs,
        first.metrics,
    )
    digest = remote.info().state_digest
    for other in ({"loss_fn": "ppo"}, {"loss_fn": "dro", "loss_fn_config": {"beta": 0.5}}):
        with pytest.raises(grpc.RpcError) as refused:
            remote.forward_backward(batch, operation_key="k", **other)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    remote.optim_step(operation_key="s", learning_rate=0.01)
    with pytest.raises(grpc.RpcError) as refused:
        remote.optim_step(operation_key="s", learning_rate=0.02)
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert remote.info().state_digest != digest


def test_a_custom_loss_equal_to_weighted_cross_entropy_gives_the_builtin_digest(
    tmp_path, model_root, llama_config
):
    import torch

    config = llama_config(lr_scheduler="constant")
    batch = tiny_token_examples(3, seed=4)

    def weighted_cross_entropy(logprobs: list[torch.Tensor]) -> torch.Tensor:
        return -sum(
            (torch.tensor(e.weights) * lp).sum() for e, lp in zip(batch, logprobs, strict=True)
        )

    with (
        running_server(tmp_path / "a", model_root) as a,
        running_server(tmp_path / "b", model_root) as b,
    ):
        custom, builtin = connect(a), connect(b)
        custom.open("run", config)
        builtin.open("run", config)
        outcome = forward_backward_custom(custom, batch, weighted_cross_entropy, operation_key="fb")
        reference = builtin.forward_backward(batch, operation_key="fb")
        assert outcome.metrics["custom_loss:sum"] == pytest.approx(reference.loss, rel=1e-6)
        custom.optim_step(operation_key="s")
        builtin.optim_step(operation_key="s")
        assert custom.info().state_digest == builtin.info().state_digest


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        (
            lambda c: c.forward_backward(tiny_token_examples(), operation_key="x", loss_fn="mse"),
            "INVALID_ARGUMENT",
            "unknown loss_fn",
        ),
        (
            lambda c: c.forward_backward(
                tiny_token_examples(), operation_key="x", loss_fn="ppo", loss_fn_config={"eps": 1.0}
            ),
            "INVALID_ARGUMENT",
            "unknown key",
        ),
        (
            lambda c: c.forward_backward(
                [TokenExample([5], [6])], operation_key="x", loss_fn="cispo"
            ),
            "INVALID_ARGUMENT",
            "cispo needs logprobs",
        ),
        (
            lambda c: c.forward_backward([TokenExample([5], [70000])], operation_key="x"),
            "INVALID_ARGUMENT",
            "outside the model's vocabulary",
        ),
        (
            lambda c: c.optim_step(operation_key="x", learning_rate=float("inf")),
            "INVALID_ARGUMENT",
            "learning_rate",
        ),
        (lambda c: c.sample([5, 6], max_tokens=0), "INVALID_ARGUMENT", "max_tokens must be in"),
        (
            lambda c: c.sample([5, 6], max_tokens=4, temperature=-1.0),
            "INVALID_ARGUMENT",
            "temperature",
        ),
        (lambda c: c.sample([], max_tokens=4), "INVALID_ARGUMENT", "prompt_tokens is empty"),
        (
            lambda c: c.sample([5, 9999], max_tokens=4),
            "INVALID_ARGUMENT",
            "prompt_tokens must be ids",
        ),
        (lambda c: c.detokenize([[1, 10**6]]), "INVALID_ARGUMENT", "outside"),
        (lambda c: c.tokenize(["x"] * 5000), "RESOURCE_EXHAUSTED", "5000 texts"),
    ],
)
def test_bad_token_requests_get_their_status_and_change_nothing(
    tmp_path, model_root, llama_config, call, code, message
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("bad", llama_config())
        client.forward_backward(tiny_token_examples(seed=2), operation_key="first")
        before = fresh_server_info(handle)
        with pytest.raises(grpc.RpcError) as refused:
            call(client)
        assert refused.value.code().name == code
        assert message in refused.value.details()
        assert fresh_server_info(handle) == before


def test_tokenize_and_detokenize_use_the_server_tokenizer(remote: SessionClient, tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    texts = ["the movie was great", "a dull film"]
    ids = remote.tokenize(texts)
    assert ids == tokenizer(texts)["input_ids"]
    assert (
        remote.tokenize(texts, add_special_tokens=False)
        == tokenizer(texts, add_special_tokens=False)["input_ids"]
    )
    assert remote.detokenize(ids) == tokenizer.batch_decode(ids)


def test_remote_samples_equal_in_process_ones(remote: SessionClient, config):
    local = TrainingSession(config, device="cpu")
    prompt = remote.tokenize(["the movie was"])[0]
    options = {"max_tokens": 8, "num_samples": 3, "temperature": 0.9, "top_k": 50, "seed": 5}
    got = remote.sample(prompt, **options)
    assert got == local.sample(prompt, **options)
    assert [s.stop_reason for s in got] == [s.stop_reason for s in local.sample(prompt, **options)]
    assert remote.info().position == 0


def test_tokenize_and_detokenize_of_nothing_are_nothing(remote: SessionClient):
    assert remote.tokenize([]) == []
    assert remote.detokenize([]) == []
