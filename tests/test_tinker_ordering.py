"""The Tinker front's seq_id ordering and its protobuf codec, without a network."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from trainwire.server.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from trainwire.server.service.request_limits import MAX_EXAMPLES, MAX_TOKENS
from trainwire.server.service.scheduler import Scheduler
from trainwire.server.tinker.codec import forward_backward_call, parse_forward_backward


def test_chunks_sent_out_of_order_run_in_seq_id_order_and_resends_run_once() -> None:
    ran: list[int] = []
    done = threading.Event()
    order = Scheduler(max_held=2)
    order.start_stream("m")

    def job(seq: int):
        def run() -> None:
            ran.append(seq)
            if len(ran) == 3:
                done.set()

        return run

    assert order.submit("m", 3, "c", job(3))
    assert order.submit("m", 2, "b", job(2))
    with pytest.raises(ResourceExhausted, match="wait for seq_id 1"):
        order.submit("m", 4, "d", job(4))
    assert order.submit("m", 1, "a", job(1))
    assert done.wait(5)
    assert ran == [1, 2, 3]
    assert not order.submit("m", 2, "b", job(2))  # a re-send: its future already exists
    with pytest.raises(AlreadyExists, match="another payload"):
        order.submit("m", 2, "other", job(2))
    order.release(lambda: None)


def test_unordered_calls_past_the_bound_are_refused_until_the_queue_drains() -> None:
    release, drained = threading.Event(), threading.Event()
    order = Scheduler(max_held=2)
    order.run_unordered(release.wait)  # the runner is busy with this one
    order.run_unordered(lambda: None)
    order.run_unordered(drained.set)
    with pytest.raises(ResourceExhausted, match="calls wait to run; retry later"):
        order.check_room()
    release.set()
    assert drained.wait(5)
    order.check_room()  # room again once they ran
    order.release(lambda: None)


def held_runner() -> tuple[Scheduler, threading.Event]:
    """An order whose runner is inside model a's first job (100 bytes) until the returned event
    is set; the bounds: 2 calls or 250 bytes per model and for samples, 400 bytes in all."""
    running, release = threading.Event(), threading.Event()
    order = Scheduler(max_held=2, max_bytes=250, max_total_bytes=400)

    def first() -> None:
        running.set()
        release.wait(30)

    order.start_stream("a")
    order.start_stream("b")
    order.submit("a", 1, "a1", first, size=100)
    assert running.wait(5)
    return order, release


def test_a_running_call_holds_its_bytes_until_it_has_run() -> None:
    order, release = held_runner()
    ran = threading.Event()
    assert order.submit("a", 2, "a2", lambda: None, size=100)  # nothing waits before it
    with pytest.raises(ResourceExhausted, match="1 calls wait to run"):
        order.submit("a", 3, "a3", lambda: None, size=100)  # 100 running + 100 waiting + 100
    release.set()
    order.run_unordered(ran.set)  # after both have run
    assert ran.wait(5)
    assert order.submit("a", 3, "a3", lambda: None, size=100)
    order.release(lambda: None)


def test_the_bytes_of_every_model_and_the_samples_are_bounded_together() -> None:
    order, release = held_runner()
    ran = threading.Event()
    assert order.submit("a", 2, "a2", lambda: None, size=100)
    assert order.submit("b", 1, "b1", lambda: None, size=150)  # 350 held in all
    with pytest.raises(ResourceExhausted, match="holds 350 bytes of decoded requests"):
        order.check_room(100)  # a sample: its own bound has room, all together have not
    with pytest.raises(ResourceExhausted, match="its bound is 400"):
        order.submit("b", 2, "b2", lambda: None, size=100)
    release.set()
    order.run_unordered(ran.set)
    assert ran.wait(5)
    order.check_room(100)
    assert order.submit("b", 2, "b2", lambda: None, size=100)
    order.release(lambda: None)


def test_the_call_a_models_held_calls_wait_for_is_taken_past_the_bound_of_all() -> None:
    """Refusing it would hold them until they time out: nothing of theirs runs without it."""
    order, release = held_runner()
    assert order.submit("b", 2, "b2", lambda: None, size=150)  # held for b's seq_id 1
    assert order.submit("a", 2, "a2", lambda: None, size=100)  # 350 held in all
    with pytest.raises(ResourceExhausted, match="its bound is 400"):
        order.submit("b", 3, "b3", lambda: None, size=100)
    assert order.submit("b", 1, "b1", lambda: None, size=100)  # what b2 waits for
    release.set()
    order.release(lambda: None)


def decode_forward_backward(body: bytes, content_encoding: str = ""):
    """What the front does with a body: parse it, then check and convert its data."""
    return forward_backward_call(parse_forward_backward(body, content_encoding))


def _request(tokens: list[int], targets: list[int]) -> pb.ForwardBackwardRequest:
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    tensor = datum.loss_fn_inputs["target_tokens"]
    tensor.dtype = pb.DTYPE_INT64
    tensor.dense = np.asarray(targets, np.int64).tobytes()
    tensor.shape.append(len(targets))
    return message


def test_forward_backward_bodies_decode_plain_and_zstd_and_bad_ones_are_refused() -> None:
    body = _request([1, 2, 3], [2, 3, 4]).SerializeToString()
    for call in (
        decode_forward_backward(body),
        decode_forward_backward(zstandard.ZstdCompressor().compress(body), "zstd"),
    ):
        assert call.examples[0].tokens == (1, 2, 3)
        assert call.examples[0].target_tokens == (2, 3, 4)
    with pytest.raises(InvalidArgument, match="values but tokens has"):
        decode_forward_backward(_request([1, 2], [2, 3, 4]).SerializeToString())
    with pytest.raises(InvalidArgument, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")


@pytest.mark.parametrize(
    ("shape", "crow", "cols", "message"),
    [
        ([2, 10**12], [0, 1, 1], [5], "at most"),  # refused before a 14 TiB allocation
        ([-1], [], [], "at most"),
        ([2, 3], [0, 1, 1], [7], "inconsistent sparse"),  # a column past the shape
        ([2, 3], [0, 2, 1], [0], "inconsistent sparse"),  # row offsets going back
    ],
    ids=["huge", "negative", "column-out-of-range", "offsets-backwards"],
)
def test_a_hostile_tensor_shape_is_refused_before_anything_is_allocated(
    shape, crow, cols, message
) -> None:
    request = _request([5, 6], [6, 7])
    tensor = request.data[0].loss_fn_inputs["target_tokens"]
    tensor.ClearField("dense")
    tensor.shape[:] = shape
    if crow:
        tensor.sparse_csr.values = np.asarray([1] * len(cols), np.int64).tobytes()
        tensor.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
        tensor.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
    with pytest.raises(InvalidArgument, match=message):
        decode_forward_backward(request.SerializeToString())


def test_too_many_datums_or_tokens_are_refused_before_they_are_decoded() -> None:
    request = _request([5, 6], [6, 7])
    for _ in range(MAX_EXAMPLES):
        request.data.add().CopyFrom(request.data[0])
    with pytest.raises(InvalidArgument, match=f"at most {MAX_EXAMPLES}"):
        decode_forward_backward(request.SerializeToString())
    request = _request([5, 6], [6, 7])
    tokens = np.zeros(MAX_TOKENS + 1, np.int32).tobytes()
    request.data[0].model_input[0].encoded_text.tokens = tokens
    with pytest.raises(InvalidArgument, match=f"{MAX_TOKENS + 1} tokens"):
        decode_forward_backward(request.SerializeToString())
