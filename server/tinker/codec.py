"""The SDK's wire types ↔ trainwire's: protobuf ForwardBackward requests and outputs, sample
requests and responses.

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

from trainwire.client.outcomes import Sample
from trainwire.client.tokens import TokenExample
from trainwire.server.errors import InvalidArgument, RequestTooLarge
from trainwire.server.service.request_limits import MAX_EXAMPLES, MAX_TOKENS
from trainwire.server.tinker.fields import (
    get_bool,
    get_dict,
    get_float,
    get_int,
    get_list,
    get_str,
    int_list,
)

MAX_BODY_BYTES = 256 * 1024 * 1024  # a decompressed forward_backward body over this is refused
INFLATE_CHUNK_BYTES = 1024 * 1024
INPUT_FIELDS = ("target_tokens", "weights", "logprobs", "advantages")
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
        body = inflate(body, MAX_BODY_BYTES)
    elif content_encoding.strip() not in ("", "identity"):
        raise InvalidArgument(f"forward_backward: unknown Content-Encoding {content_encoding!r}")
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf raises DecodeError, a plain Exception subclass
        raise InvalidArgument(f"forward_backward: not a ForwardBackwardRequest: {error}") from None
    return message


def inflate(body: bytes, limit: int) -> bytearray:
    """A zstd body decompressed, refused (413, RequestTooLarge) as soon as it passes ``limit``
    bytes: read a chunk at a time, so a few KiB that would inflate to gigabytes cost at most
    ``limit`` and are refused as too large (a retry would be refused again), not as busy."""
    inflated = bytearray()  # grown in place: no second copy of up to ``limit`` bytes
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        while chunk := reader.read(INFLATE_CHUNK_BYTES):
            if len(inflated) + len(chunk) > limit:
                raise RequestTooLarge(
                    f"forward_backward: the zstd body inflates past {limit} bytes, this "
                    "server's bound for it; send fewer datums per request"
                )
            inflated += chunk
    except zstandard.ZstdError as error:
        raise InvalidArgument(f"forward_backward: the zstd body is corrupt: {error}") from None
    return inflated


def forward_backward_call(message: pb.ForwardBackwardRequest) -> ForwardBackwardCall:
    """A parsed request's data and loss as trainwire values; InvalidArgument naming the datum."""
    if not message.data:
        raise InvalidArgument("forward_backward: no data; send at least one Datum")
    if len(message.data) > MAX_EXAMPLES:
        raise InvalidArgument(
            f"forward_backward: {len(message.data)} datums; at most {MAX_EXAMPLES}"
        )
    tokens = sum(len(c.encoded_text.tokens) // 4 for d in message.data for c in d.model_input)
    if tokens > MAX_TOKENS:  # counted from the bytes, before a list is built
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
    """The v2 map when it is set (the SDK dual-writes numbers into both), else the legacy one."""
    if message.loss_fn_config_v2:
        config = {}
        for key, value in message.loss_fn_config_v2.items():
            if value.WhichOneof("value") == "text":
                raise InvalidArgument(f"loss_fn_config[{key!r}]: text values are not supported")
            config[key] = value.number
        return config
    return dict(message.loss_fn_config.items())


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


def encode_sample_response(
    samples: Sequence[Sample], prompt_logprobs: Sequence[float] | None = None
) -> bytes:
    """A protobuf ``SampleResponse``: tokens int32, logprobs float32, the stop reason."""
    message = pb.SampleResponse()
    for sample in samples:
        reason = pb.STOP_REASON_STOP if sample.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        message.sequences.add(
            stop_reason=reason,
            tokens=np.asarray(sample.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sample.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()


@dataclass(frozen=True)
class SampleCall:
    """One decoded /asample request, in ``TrainingSession.sample``'s terms."""

    sampling_session_id: str
    seq_id: int
    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_tokens: tuple[int, ...]
    seed: int | None
    prompt_logprobs: bool


UNSUPPORTED_SAMPLE_OPTIONS = (
    "topk_prompt_logprobs",
    "topk_sample_logprobs",
    "prompt_alt_tokens_k",
)


# What one asample may ask for, checked here because the route logs the request right after
# decoding it: a request the engine would refuse for its size never reaches the log. These are
# the engine's SamplingLimits defaults (a test keeps them equal; the front imports nothing of the
# engine). The model's positions are the engine's to check: the codec does not know the model.
MAX_SAMPLES = 64
MAX_SAMPLE_TOKENS = 4096  # max_tokens
MAX_PROMPT_TOKENS = 32768
MAX_SAMPLE_POSITIONS = 64 * 4096  # num_samples x (prompt + max_tokens): what decoding holds
MAX_STOP_TOKENS = 1024
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32
MAX_SEED = 2**63 - 1


def decode_sample(body: Mapping[str, Any]) -> SampleCall:
    """A JSON ``SampleRequest`` with every setting within its bound; options this server
    cannot honour are refused, never ignored. InvalidArgument naming every problem at once."""
    problems = [f"{name} is not supported" for name in UNSUPPORTED_SAMPLE_OPTIONS if body.get(name)]
    for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        if body.get(name) is not None:
            problems.append(f"{name} is not supported")
    sampling_session_id = get_str(body, "sampling_session_id") or ""
    if not sampling_session_id:
        problems.append("sampling_session_id is missing: create a sampling session first")
    params = get_dict(body, "sampling_params") or {}
    stop = _stop_tokens(params.get("stop"), problems)
    prompt = _prompt_tokens(get_dict(body, "prompt") or {}, problems)
    max_tokens = get_int(params, "max_tokens")
    if max_tokens is None:
        problems.append("sampling_params.max_tokens is required")
    top_k = _int(params, "top_k", -1)
    call = SampleCall(
        sampling_session_id=sampling_session_id,
        seq_id=_int(body, "seq_id", 0),
        prompt=tuple(prompt),
        num_samples=_int(body, "num_samples", 1),
        max_tokens=max_tokens or 0,
        temperature=_float(params, "temperature", 1.0),
        top_p=_float(params, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # the SDK's -1 is trainwire's 0: keep every token
        stop_tokens=stop,
        seed=get_int(params, "seed"),
        prompt_logprobs=get_bool(body, "prompt_logprobs"),
    )
    if max_tokens is not None:
        problems += _sample_bounds(call, top_k)
    if problems:
        raise InvalidArgument("asample: " + "; ".join(problems))
    return call


def _sample_bounds(call: SampleCall, top_k: int) -> list[str]:
    """Every setting of ``call`` against its bound (``top_k`` as the SDK sent it)."""
    ranges = (
        ("num_samples", call.num_samples, 1, MAX_SAMPLES),
        ("sampling_params.max_tokens", call.max_tokens, 1, MAX_SAMPLE_TOKENS),
        ("sampling_params.top_k", top_k, -1, MAX_TOKEN_ID),
        ("sampling_params.seed", MAX_SEED if call.seed is None else call.seed, 0, MAX_SEED),
        ("seq_id", call.seq_id, 0, MAX_SEED),
    )
    problems = [
        f"{name} must be in [{low}, {high}], got {value}"
        for name, value, low, high in ranges
        if not low <= value <= high
    ]
    if call.temperature < 0:
        problems.append(f"sampling_params.temperature must be >= 0, got {call.temperature}")
    if not 0 < call.top_p <= 1:
        problems.append(f"sampling_params.top_p must be in (0, 1], got {call.top_p}")
    if len(call.stop_tokens) > MAX_STOP_TOKENS:
        problems.append(f"{len(call.stop_tokens)} stop tokens; at most {MAX_STOP_TOKENS}")
    elif any(not 0 <= token <= MAX_TOKEN_ID for token in call.stop_tokens):
        problems.append(f"sampling_params.stop must hold token ids in [0, {MAX_TOKEN_ID}]")
    problems += _prompt_bounds(call.prompt)
    if not problems:  # a product of counts each within its bound
        positions = call.num_samples * (len(call.prompt) + call.max_tokens)
        if positions > MAX_SAMPLE_POSITIONS:
            problems.append(
                f"num_samples {call.num_samples} x (prompt {len(call.prompt)} + max_tokens "
                f"{call.max_tokens}) is {positions} token positions at once; at most "
                f"{MAX_SAMPLE_POSITIONS}: ask for fewer samples, or shorter ones"
            )
    return problems


def _prompt_bounds(prompt: Sequence[int]) -> list[str]:
    if not prompt:
        return ["the prompt holds no tokens: give at least one"]
    if len(prompt) > MAX_PROMPT_TOKENS:
        return [f"the prompt has {len(prompt)} tokens; at most {MAX_PROMPT_TOKENS}"]
    if any(not 0 <= token <= MAX_TOKEN_ID for token in prompt):
        return [f"the prompt must hold token ids in [0, {MAX_TOKEN_ID}]"]
    return []


def _int(body: Mapping[str, Any], name: str, default: int) -> int:
    value = get_int(body, name, default)
    return default if value is None else value


def _float(body: Mapping[str, Any], name: str, default: float) -> float:
    value = get_float(body, name, default)
    return default if value is None else value


def _stop_tokens(stop: Any, problems: list[str]) -> tuple[int, ...]:
    """``sampling_params.stop`` as token ids; what this server cannot honour goes to
    ``problems``."""
    if isinstance(stop, str) or (
        isinstance(stop, list)
        and not all(isinstance(s, int) and not isinstance(s, bool) for s in stop)
    ):
        problems.append("stop strings are not supported: give stop token ids")
    elif stop is not None and not isinstance(stop, list):
        problems.append(f"sampling_params.stop must be a list of token ids, got {stop!r:.40}")
    elif stop is not None and len(stop) == 0:
        problems.append("stop=[] (no EOS stop) is not supported; give max_tokens instead")
    else:
        return tuple(stop or ())
    return ()


def _prompt_tokens(prompt: Mapping[str, Any], problems: list[str]) -> list[int]:
    tokens: list[int] = []
    for chunk in get_list(prompt, "chunks") or ():
        if not isinstance(chunk, dict):
            raise InvalidArgument(f"asample: prompt.chunks holds {chunk!r:.40}, not an object")
        if chunk.get("type", "encoded_text") != "encoded_text":
            problems.append(
                f"prompt: {chunk.get('type')!r:.40} chunks are not supported; send tokens"
            )
            continue
        tokens.extend(int_list(get_list(chunk, "tokens") or [], "prompt chunk tokens"))
    return tokens
