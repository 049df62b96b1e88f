"""A forward_backward body is bounded by what a valid request can be, and what its decoded datums
hold is counted before they are decoded; without a network.

A review found a 10 KiB zstd body inflating to the flat 256 MiB bound before it was refused (three
at once: 735 MB), and calls taken by their wire bytes though decoded they hold several times more.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from trainwire.server.errors import RequestTooLarge
from trainwire.server.service.request_limits import MAX_EXAMPLES, MAX_TOKENS
from trainwire.server.tinker.codec import (
    INFLATE_CHUNK_BYTES,
    INPUT_FIELDS,
    MAX_FORWARD_BACKWARD_BYTES,
    forward_backward_call,
    held_bytes,
    parse_forward_backward,
)


def datum_of(message: pb.ForwardBackwardRequest, ids: np.ndarray, *, chunks: int = 1) -> None:
    """A datum of ``ids`` (int32 tokens in ``chunks`` chunks) with every per-token input at
    int64, the widest dtype the codec takes."""
    datum = message.data.add()
    for part in np.array_split(ids.astype(np.int32), chunks):
        datum.model_input.add().encoded_text.tokens = part.tobytes()
    for name in INPUT_FIELDS:
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = pb.DTYPE_INT64
        tensor.dense = ids.astype(np.int64).tobytes()
        tensor.shape.append(len(ids))


def request() -> pb.ForwardBackwardRequest:
    return pb.ForwardBackwardRequest(model_id="m" * 64, seq_id=2**31 - 1, loss_fn="ppo")


def test_the_largest_valid_forward_backward_is_within_the_routes_bound() -> None:
    """Every datum and position at its limit, each input at int64; and, per position, a token in
    a chunk of its own (the most framing a valid body has)."""
    widest = request()
    per_datum = MAX_TOKENS // MAX_EXAMPLES
    for _ in range(MAX_EXAMPLES):
        datum_of(widest, np.full(per_datum, 2**31 - 1))
    assert widest.ByteSize() <= MAX_FORWARD_BACKWARD_BYTES
    assert widest.ByteSize() > MAX_FORWARD_BACKWARD_BYTES * 3 // 4  # the bound is not slack
    chunked = request()
    datum_of(chunked, np.full(4096, 2**31 - 1), chunks=4096)
    per_position = 4 + 6 + 8 * len(INPUT_FIELDS)  # as the bound counts a position
    assert chunked.ByteSize() - request().ByteSize() <= 4096 * per_position + 512


def zstd_bomb(size: int, *, declared: bool) -> bytes:
    """``size`` zero bytes, compressed a MiB at a time; ``declared``: the frame's header says
    how many (as the SDK's one-shot compression writes it), else the stream alone does."""
    compressor = zstandard.ZstdCompressor().compressobj(size=size if declared else -1)
    chunk = bytes(1024 * 1024)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, compressor.flush()])


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "streamed"])
def test_a_zstd_bomb_is_refused_at_the_routes_bound_having_inflated_no_more(declared) -> None:
    body = zstd_bomb(4 * MAX_FORWARD_BACKWARD_BYTES, declared=declared)
    assert len(body) < 64 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(RequestTooLarge, match=f"past {MAX_FORWARD_BACKWARD_BYTES} bytes"):
            parse_forward_backward(body, "zstd")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if declared:  # refused by its header, before a byte is inflated
        assert peak < INFLATE_CHUNK_BYTES
    else:  # the body grows in place, up to an eighth over the bound, beside one chunk read
        assert peak <= MAX_FORWARD_BACKWARD_BYTES * 9 // 8 + 2 * INFLATE_CHUNK_BYTES


def decoded_bytes(message: pb.ForwardBackwardRequest) -> int:
    """What decoding ``message`` into the call the engine takes really holds, measured."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        call = forward_backward_call(message)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(call.examples) == len(message.data)
    return held


def test_what_a_decoded_request_holds_is_counted_before_it_is_decoded() -> None:
    """The estimate the bound of waiting calls counts is at least what decoding really holds,
    and not far over it for ids past the small integers Python shares."""
    message = request()
    rng = np.random.default_rng(0)
    for _ in range(16):
        datum_of(message, rng.integers(257, 100_000, size=512))
    held = decoded_bytes(message)
    assert held <= held_bytes(message) <= 1.25 * held
