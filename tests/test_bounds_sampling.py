"""Sampling is bounded before any work, by what it costs: what one request holds at once grows
with samples × (prompt + max_tokens), so that product is bounded, not only each count; and a
prompt plus max_tokens past the model's positions is refused, with the limit, as training
refuses a sequence past max_length.
"""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
from fresh_state import fresh_digest, fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import LoraSettings, TrainingConfig
from trainwire.server.engine.sampling import sampler as sampling
from trainwire.server.engine.sampling.params import SamplingLimits, SamplingParams
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument

POSITIONS = 256  # the tiny llama's max_position_embeddings


@pytest.fixture(scope="module")
def session(llama_config) -> TrainingSession:
    lora = LoraSettings(r=4, alpha=8, dropout=0.0)
    return TrainingSession(llama_config(lora=lora, lr_scheduler="constant"), device="cpu")


def no_work(*args, **kwargs):
    raise AssertionError("a request past its bounds reached the decoder")


def test_samples_times_positions_is_bounded_not_each_count_alone():
    limits = SamplingLimits()  # a model with positions enough for any prompt
    each_within = SamplingParams(max_tokens=1, num_samples=limits.max_samples)
    prompt = [1] * limits.max_prompt_tokens
    with pytest.raises(InvalidArgument, match=r"num_samples 64 x \(prompt 32768 \+ max_tokens 1\)"):
        each_within.check(prompt, 100, limits)
    SamplingParams(max_tokens=1, num_samples=7).check(prompt, 100, limits)  # 7 x 32769 fits


def test_a_session_refuses_the_product_before_it_decodes(tiny_llama, tmp_path, monkeypatch):
    # The same tiny model, with positions for the longest prompt the limits allow.
    model = tmp_path / "long-llama"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    session = TrainingSession(TrainingConfig(model=str(model), max_length=64), device="cpu")
    monkeypatch.setattr(sampling, "generate", no_work)  # 64 prefills of 32,768: ~64 GiB
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match="token positions at once; the limit is 262144"):
        session.sample([5] * 32768, max_tokens=1, num_samples=64)
    assert fresh_digest(session) == before


def test_a_prompt_plus_max_tokens_past_the_models_positions_is_refused(session, monkeypatch):
    monkeypatch.setattr(sampling, "generate", no_work)
    before = fresh_digest(session)
    with pytest.raises(InvalidArgument, match=r"make 300 positions; the model has 256"):
        session.sample([5] * 200, max_tokens=100)
    with pytest.raises(InvalidArgument, match=r"the prompt has 300 tokens; the model has 256"):
        session.prompt_logprobs([5] * 300)
    assert fresh_digest(session) == before
    monkeypatch.undo()
    (fits,) = session.sample([5] * 200, max_tokens=POSITIONS - 200, temperature=0)
    assert len(fits.tokens) <= POSITIONS - 200


def test_grpc_sample_past_the_positions_is_invalid_argument_with_the_limit(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("positions", llama_config())
        before = fresh_server_info(handle)
        with pytest.raises(grpc.RpcError) as refused:
            client.sample([5] * 250, max_tokens=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the model has 256 (its max_position_embeddings)" in refused.value.details()
        assert fresh_server_info(handle) == before
        client.close_channel()
