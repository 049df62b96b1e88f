"""Every sampling value the engine accepts is one it can compute: a temperature or top_p near 0
samples the limit it asks for (the most likely tokens) instead of crashing the draw with
"probability tensor contains inf/nan", over every transport; ordinary values draw exactly what
they drew before, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math

import grpc
import pytest
import torch
from fresh_state import fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.client import LoraSettings
from trainwire.server.engine.sampling import draws
from trainwire.server.engine.sampling.params import SamplingParams
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument


@pytest.fixture(scope="module")
def session(llama_config) -> TrainingSession:
    lora = LoraSettings(r=4, alpha=8, dropout=0.0)
    return TrainingSession(llama_config(lora=lora, lr_scheduler="constant"), device="cpu")


def digest(samples) -> str:
    rows = [(s.tokens, [float.hex(v) for v in s.logprobs], s.stop_reason) for s in samples]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1e-300},
        {"temperature": 5e-324},
        {"temperature": 1e-40},
        {"top_p": 5e-324},
        {"top_p": 1e-46},
        {"temperature": 1e-300, "top_p": 5e-324, "top_k": 3},
    ],
)
def test_a_temperature_or_top_p_near_zero_samples_the_most_likely_tokens(session, options):
    prompt = session.tokenize(["the movie was"])[0]
    greedy = session.sample(prompt, max_tokens=6, num_samples=2, temperature=0)
    assert digest(session.sample(prompt, max_tokens=6, num_samples=2, **options)) == digest(greedy)


def test_values_that_cannot_be_numbers_are_refused(session):
    for options in ({"temperature": 10**400}, {"top_p": 10**400}, {"temperature": -1e-300}):
        with pytest.raises(InvalidArgument, match="must be"):
            session.sample([5, 6], max_tokens=2, **options)


def old_choose(logits, params, generator):
    """``draws.next_tokens`` before near-zero values were handled, verbatim: the reference."""
    if params.temperature == 0:
        return torch.argmax(logits, dim=-1)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        ordered_probabilities = torch.softmax(ordered, dim=-1)
        drop = (ordered_probabilities.cumsum(dim=-1) - ordered_probabilities) >= params.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
    probabilities = torch.softmax(logits, dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


@pytest.mark.parametrize("temperature", [0, 0.05, 0.3, 0.7, 1, 1.0, 1.3, 2, 7.5])
@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 0), (0.9, 0), (0.5, 40), (0.05, 0), (1, 5)])
def test_ordinary_values_draw_exactly_what_they_drew_before(temperature, top_p, top_k):
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k)
    logits = torch.randn(16, 512, generator=torch.Generator().manual_seed(7)) * 6
    new, old = (torch.Generator().manual_seed(11) for _ in range(2))
    for _ in range(8):
        assert torch.equal(draws.next_tokens(logits, params, new), old_choose(logits, params, old))
    assert torch.equal(new.get_state(), old.get_state())


def test_a_tiny_temperature_over_grpc_is_a_sample_never_internal(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        client.open("tiny-temperature", llama_config())
        before = fresh_server_info(handle)  # samples and refusals change nothing
        drawn = client.sample([5, 6, 7], max_tokens=4, num_samples=2, temperature=1e-300)
        greedy = client.sample([5, 6, 7], max_tokens=4, num_samples=2, temperature=0)
        assert digest(drawn) == digest(greedy)
        with pytest.raises(grpc.RpcError) as refused:
            client.sample([5, 6, 7], max_tokens=4, temperature=-1e-300)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fresh_server_info(handle) == before
        client.close_channel()
