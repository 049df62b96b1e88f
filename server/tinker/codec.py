"""The SDK's wire types ↔ trainwire's for training calls: protobuf ForwardBackward requests and
outputs (sample requests and responses are ``sample_codec``'s).

Protobuf classes come from the SDK itself (``tinker.proto``), so the bytes stay compatible with
the SDK version installed beside the server. Every refusal is an ``InvalidArgument`` that names
the datum and field, raised before anything runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from tinker.proto import tinker_public_pb2 as pb

from trainwire.contract.tokens import TokenExample
from trainwire.server.errors import InvalidArgument, RequestTooLarge
from trainwire.server.service.request_limits import MAX_EXAMPLES, MAX_TOKENS

PROTOBUF = "application/x-protobuf"  # the media type of the SDK's protobuf bodies
INPUT_FIELDS = ("target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask")
# The largest body a valid forward_backward can be, plain or inflated; past it a body is refused
# (413) before it is parsed, or while it inflates. MAX_TOKENS positions, each an int32 token in a
# chunk of its own at worst (4 bytes and 6 of framing) and every loss_fn_input at the widest
# dtype (int64); each of MAX_EXAMPLES datums' framing (five named tensors with their shapes,
# under 512 bytes); 1 MiB for the rest (model_id, loss_fn, its config, provenance spans).
MAX_FORWARD_BACKWARD_BYTES = (
    MAX_TOKENS * (4 + 6 + 8 * len(INPUT_FIELDS)) + MAX_EXAMPLES * 512 + 1024 * 1024
)
INFLATE_CHUNK_BYTES = 1024 * 1024
# What one value of a decoded request holds in memory: its tuple slot (8 bytes) and its object (an
# int or a float of 24 to 28 bytes, in a 32-byte block of Python's allocator). Ids under 257 are
# objects Python shares, so a position costs at most this per value it carries.
BYTES_PER_DECODED_VALUE = 40
DECODED_DATUM_BYTES = 1024  # a datum's TokenExample and its tuples, past their values
# The most a valid request holds decoded (about 240 MiB); a larger estimate is of a request its
# checks refuse, which then holds nothing.
MAX_HELD_BYTES = (
    MAX_TOKENS * (1 + len(INPUT_FIELDS)) * BYTES_PER_DECODED_VALUE
    + MAX_EXAMPLES * DECODED_DATUM_BYTES
)
MAX_TENSOR_VALUES = MAX_TOKENS  # per loss_fn_input, checked before anything is allocated
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True)
class ForwardBackwardCall:
    """One decoded /forward_backward chunk."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    examples: tuple[TokenExample, ...]


def parse_forward_backward(
    body: bytes | bytearray, content_encoding: str = ""
) -> pb.ForwardBackwardRequest:
    """The SDK's protobuf ``ForwardBackwardRequest`` (optionally zstd), not yet checked: its
    model_id and seq_id are known from here on (``forward_backward_call`` checks the rest)."""
    if content_encoding.strip().lower() == "zstd":
        body = inflate(body, MAX_FORWARD_BACKWARD_BYTES)
    elif content_encoding.strip() not in ("", "identity"):
        raise InvalidArgument(f"forward_backward: unknown Content-Encoding {content_encoding!r}")
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf raises DecodeError, a plain Exception subclass
        raise InvalidArgument(f"forward_backward: not a ForwardBackwardRequest: {error}") from None
    return message


def inflate(body: bytes, limit: int) -> bytearray:
    """A zstd body decompressed, refused (413, RequestTooLarge) once it passes ``limit`` bytes:
    at once when its frame header declares more, else as soon as the stream does (read a chunk
    at a time), so a few KiB that would inflate to gigabytes cost at most ``limit`` and are
    refused as too large (a retry would be refused again), not as busy."""
    try:
        declared = zstandard.frame_content_size(body)  # -1: not declared
        if declared > limit:
            raise RequestTooLarge(too_large(limit, f"its frame header declares {declared}"))
        inflated = bytearray()  # grown in place: no second copy of up to ``limit`` bytes
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        while chunk := reader.read(INFLATE_CHUNK_BYTES):
            if len(inflated) + len(chunk) > limit:
                raise RequestTooLarge(too_large(limit, "the stream did"))
            inflated += chunk
    except zstandard.ZstdError as error:
        raise InvalidArgument(f"forward_backward: the zstd body is corrupt: {error}") from None
    return inflated


def too_large(limit: int, why: str) -> str:
    return (
        f"forward_backward: the zstd body inflates past {limit} bytes ({why}), more than a "
        "valid request can be; send fewer datums per request"
    )


def held_bytes(message: pb.ForwardBackwardRequest) -> int:
    """What ``forward_backward_call`` will hold of this request, counted before it decodes
    anything: each datum's positions times the values each carries (its token and every
    per-token input), at ``BYTES_PER_DECODED_VALUE`` each."""
    held = 0
    for datum in message.data:
        fields = sum(1 for name in datum.loss_fn_inputs if name in INPUT_FIELDS)
        values = _positions(datum) * (1 + fields)
        held += values * BYTES_PER_DECODED_VALUE + DECODED_DATUM_BYTES
        if held > MAX_HELD_BYTES:
            return MAX_HELD_BYTES
    return held


def _positions(datum: pb.Datum) -> int:
    """A datum's tokens, counted from their bytes (int32) before a list is built."""
    return sum(len(chunk.encoded_text.tokens) // 4 for chunk in datum.model_input)


def forward_backward_call(message: pb.ForwardBackwardRequest) -> ForwardBackwardCall:
    """A parsed request's data and loss as trainwire values; InvalidArgument naming the datum."""
    if not message.data:
        raise InvalidArgument("forward_backward: no data; send at least one Datum")
    if len(message.data) > MAX_EXAMPLES:
        raise InvalidArgument(
            f"forward_backward: {len(message.data)} datums; at most {MAX_EXAMPLES}"
        )
    tokens = sum(_positions(datum) for datum in message.data)
    if tokens > MAX_TOKENS:
        raise InvalidArgument(f"forward_backward: {tokens} tokens; at most {MAX_TOKENS}")
    examples = tuple(_example(i, datum) for i, datum in enumerate(message.data))
    return ForwardBackwardCall(
        message.model_id,
        message.seq_id,
        message.loss_fn,
        _loss_config(message),
        message.forward_only,
        examples,
    )


def _loss_config(message: pb.ForwardBackwardRequest) -> dict[str, float]:
    """The loss config from ``loss_fn_config_v2``, where the SDK writes every key (it copies the
    numbers into ``loss_fn_config`` too); a key sent only in that second map is refused, never
    silently dropped."""
    config = {}
    for key, value in message.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise InvalidArgument(f"loss_fn_config[{key!r}]: text values are not supported")
        config[key] = value.number
    unread = sorted(set(message.loss_fn_config) - set(config))
    if unread:
        raise InvalidArgument(
            f"loss_fn_config: {', '.join(unread)} sent only in the number map; send every key "
            "in loss_fn_config_v2, as the tinker SDK does"
        )
    return config


def _example(index: int, datum: pb.Datum) -> TokenExample:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(
                f"data[{index}].model_input: {kind} chunks are not supported; send tokens"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    unknown = sorted(set(datum.loss_fn_inputs) - set(INPUT_FIELDS))
    if unknown:
        raise InvalidArgument(
            f"data[{index}].loss_fn_inputs: unknown {unknown}; this server takes {INPUT_FIELDS}"
        )
    if "target_tokens" not in datum.loss_fn_inputs:
        raise InvalidArgument(f"data[{index}].loss_fn_inputs: target_tokens is missing")
    fields: dict[str, Any] = {}
    for name in INPUT_FIELDS:
        if name in datum.loss_fn_inputs:
            array = _dense(f"data[{index}].loss_fn_inputs.{name}", datum.loss_fn_inputs[name])
            fields[name] = array.tolist()
    try:
        return TokenExample(tokens=tokens, **fields)
    except ValueError as error:
        raise InvalidArgument(f"data[{index}]: {error}") from None


def _dense(what: str, tensor: pb.Tensor) -> np.ndarray:
    """A 1-D tensor as a numpy array (sparse CSR densified with 0, as the SDK writes it)."""
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise InvalidArgument(f"{what}: dtype {pb.DType.Name(tensor.dtype)} is not supported")
    shape = list(tensor.shape)
    if any(size < 0 for size in shape) or math.prod(shape) > MAX_TENSOR_VALUES:
        raise InvalidArgument(f"{what}: shape {shape}; at most {MAX_TENSOR_VALUES} values")
    if tensor.HasField("sparse_csr"):
        if len(shape) != 2:
            raise InvalidArgument(f"{what}: a sparse tensor needs a 2-D shape, got {shape}")
        csr = tensor.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        if (
            len(crow) != shape[0] + 1
            or len(cols) != len(values)
            or crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
            or np.any((cols < 0) | (cols >= shape[1]))
        ):
            raise InvalidArgument(f"{what}: inconsistent sparse CSR indices")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            dense[row, cols[crow[row] : crow[row + 1]]] = values[crow[row] : crow[row + 1]]
        array = dense
    else:
        array = np.frombuffer(tensor.dense, dtype=dtype)
        if shape and math.prod(shape) != array.size:
            raise InvalidArgument(f"{what}: shape {shape} does not hold {array.size} values")
        if shape:
            array = array.reshape(shape)
    if array.ndim != 1:
        raise InvalidArgument(
            f"{what}: shape {list(array.shape)}; this server takes one value per position (1-D)"
        )
    return array


def encode_forward_backward_output(
    logprobs: Sequence[Sequence[float]],
    elementwise_loss: Sequence[Sequence[float]],
    metrics: Mapping[str, float],
) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: per-datum ``logprobs`` and ``elementwise_loss``
    (float32, as the SDK reads them) and the metrics, every key ``name:reduction``."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    message.metrics.update({key: float(value) for key, value in metrics.items()})
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    for name, rows in (("logprobs", logprobs), ("elementwise_loss", elementwise_loss)):
        arrays = [np.asarray(row, dtype=np.float32) for row in rows]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
    return message.SerializeToString()
