"""A stored call's request reads back equal to the accepted one, bit for bit: what a restart
queues again is what was accepted (``request_bodies``)."""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainwire.contract.config import InputExample
from trainwire.contract.outcomes import WeightsSource
from trainwire.contract.tokens import TokenExample
from trainwire.server.service.request_bodies import request_body, request_of
from trainwire.server.service.requests import (
    CheckpointRequest,
    ExportWeightsRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadWeightsRequest,
    OptimStepRequest,
)

# Floats of either width and ids of either size: each array takes the narrow type only where it
# holds every value exactly.
finite = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
)


@st.composite
def token_examples(draw: st.DrawFn) -> TokenExample:
    n = draw(st.integers(1, 12))
    ids = st.lists(st.integers(0, 2**40), min_size=n, max_size=n)
    floats = st.one_of(st.none(), st.lists(finite, min_size=n, max_size=n))
    return TokenExample(
        draw(ids),
        draw(ids),
        weights=draw(floats),
        logprobs=draw(floats),
        advantages=draw(floats),
        sequence_ratio_mask=draw(floats),
    )


def stored(request: object) -> object:
    """``request`` written as the ledger writes a record's JSON, and read back."""
    text = json.dumps(request_body(request), sort_keys=True, separators=(",", ":"))
    return request_of(type(request), json.loads(text))


def bits(values: tuple[float, ...] | None) -> list[bytes] | None:
    return None if values is None else [struct.pack("<d", v) for v in values]


@given(st.lists(token_examples(), min_size=1, max_size=4), st.dictionaries(st.text(), finite))
def test_token_batches_read_back_bit_for_bit(examples: list[TokenExample], config: dict) -> None:
    for request_type in (ForwardRequest, ForwardBackwardRequest):
        request = request_type(tuple(examples), "ppo", config)
        back = stored(request)
        assert back == request and type(back) is request_type
        for mine, theirs in zip(request.examples, back.examples, strict=True):  # -0.0 too
            for name in ("weights", "logprobs", "advantages", "sequence_ratio_mask"):
                assert bits(getattr(mine, name)) == bits(getattr(theirs, name))


def test_each_array_is_stored_in_the_narrowest_type_that_holds_it_exactly() -> None:
    """A vocabulary's ids and float32 values take half the bytes; an id past int32 or a float
    float32 would round keeps the wide type, and every one reads back exactly."""
    narrow = TokenExample([5, 2**31 - 1], [7, 0], weights=[0.5, -0.0])
    wide = TokenExample([5, 2**31], [7, 0], weights=[0.1, 1.0])
    bodies = [request_body(ForwardRequest((example,)))["examples"][0] for example in (narrow, wide)]
    assert [body["tokens"][:3] for body in bodies] == ["i4:", "i8:"]
    assert [body["target_tokens"][:3] for body in bodies] == ["i4:", "i4:"]
    assert [body["weights"][:3] for body in bodies] == ["f4:", "f8:"]
    for example in (narrow, wide):
        (back,) = stored(ForwardRequest((example,))).examples
        assert back == example and bits(back.weights) == bits(example.weights)


def test_every_other_request_a_call_stores_reads_back_equal() -> None:
    requests = [
        ForwardBackwardRequest((InputExample("a text", completion=" more"),)),
        OptimStepRequest(1e-4, True, 0.9, 0.95, 1e-8, 0.0, math.pi),
        OptimStepRequest(),
        CheckpointRequest("ck-1", "run-a"),
        LoadWeightsRequest(WeightsSource("checkpoint", "ck-1"), "run-a"),
        ExportWeightsRequest("sampler-3-x", written_once="sampler weights 'x'"),
    ]
    for request in requests:
        assert stored(request) == request


@pytest.mark.parametrize(
    "body",
    [
        ["not", "an", "object"],
        {"name": "x", "unknown": 1},
        {"examples": [{"tokens": "A", "x": 1}]},
        {"examples": [{"text": "a", "unknown": 1}]},
        {"examples": [{"tokens": "not base64!", "target_tokens": "AAAAAAAAAAA="}]},
    ],
)
def test_a_body_that_holds_no_request_is_a_value_error(body: object) -> None:
    request_type = (
        ForwardRequest if isinstance(body, dict) and "examples" in body else CheckpointRequest
    )
    with pytest.raises(ValueError):
        request_of(request_type, body)
