"""A forward_backward's loss config is read from the map the SDK writes every key into
(``loss_fn_config_v2``), from the SDK's own encoding of its request."""

from __future__ import annotations

import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker.codec import forward_backward_call


def sdk_request(loss_fn_config: dict[str, float | str] | None) -> pb.ForwardBackwardRequest:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64", shape=[3]),
            "logprobs": types.TensorData(data=[-1.0, -1.0, -1.0], dtype="float32", shape=[3]),
            "advantages": types.TensorData(data=[1.0, 0.0, -1.0], dtype="float32", shape=[3]),
        },
    )
    fb_input = types.ForwardBackwardInput(
        data=[datum], loss_fn="ppo", loss_fn_config=loss_fn_config
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=fb_input, model_id="tw-1:train:0", seq_id=1
    )
    return forward_backward_request_to_proto(request)


def test_the_loss_config_the_sdk_sends_is_read_whole() -> None:
    config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    assert forward_backward_call(sdk_request(config)).loss_fn_config == config
    assert forward_backward_call(sdk_request(None)).loss_fn_config == {}


def test_a_text_value_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"loss_fn_config\['mode'\]: text values"):
        forward_backward_call(sdk_request({"mode": "fast"}))


def test_a_key_sent_only_in_the_number_map_is_refused_not_dropped() -> None:
    message = sdk_request({"clip_low_threshold": 0.7})
    message.loss_fn_config["clip_high_threshold"] = 1.3
    with pytest.raises(InvalidArgument, match="clip_high_threshold sent only in the number map"):
        forward_backward_call(message)
