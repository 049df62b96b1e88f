"""The SDK's sample requests and responses ↔ trainwire's: ``asample`` bodies decoded and bounded,
``SampleResponse`` protobufs encoded.

Every setting is bounded here, before the route logs the request: a request the engine would
refuse for its size (``SamplingLimits``, kept equal by a test) never reaches the request store,
where a restart would read it back. Every refusal is an ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from trainwire.contract.outcomes import PromptLogprobs, Sample, TopLogprobs
from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker.fields import (
    get_bool,
    get_dict,
    get_int,
    get_list,
    get_setting,
    get_str,
    int_list,
    is_non_negative_int,
)


def encode_sample_response(
    samples: Sequence[Sample], prompt_logprobs: PromptLogprobs | None = None
) -> bytes:
    """A protobuf ``SampleResponse``: tokens int32, logprobs float32, the stop reason, and what
    the request asked about its samples' top k and its prompt, in the SDK's shapes."""
    message = pb.SampleResponse()
    for sample in samples:
        reason = pb.STOP_REASON_STOP if sample.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        sequence = message.sequences.add(
            stop_reason=reason,
            tokens=np.asarray(sample.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sample.logprobs, dtype=np.float32).tobytes(),
        )
        if sample.topk_logprobs is not None:
            sequence.topk_sampled_logprobs.CopyFrom(_topk(sample.topk_logprobs))
    if prompt_logprobs is not None:
        _encode_prompt(message, prompt_logprobs)
    return message.SerializeToString()


def _encode_prompt(message: pb.SampleResponse, scored: PromptLogprobs) -> None:
    if scored.logprobs is not None:
        message.prompt_logprobs = np.asarray(scored.logprobs, dtype=np.float32).tobytes()
    if scored.topk is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(scored.topk, scored.first))
    if scored.targets is not None:
        message.target_prompt_logprobs.CopyFrom(_targets(scored.targets))


def _topk(top: TopLogprobs, unscored: int = 0) -> pb.TopkLogprobs:
    """The SDK's ``TopkLogprobs``: two dense ``(length, k)`` matrices, ``unscored`` positions
    first filled with its sentinel (id 0, logprob ``MASK_LOGPROB``), which the SDK reads as
    None."""
    length = unscored + len(top)
    ids = np.zeros((length, top.k), dtype=np.int32)
    values = np.full((length, top.k), MASK_LOGPROB, dtype=np.float32)
    ids[unscored:] = np.frombuffer(top.ids, dtype=np.int32).reshape(-1, top.k)
    values[unscored:] = np.frombuffer(top.logprobs, dtype=np.float32).reshape(-1, top.k)
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=values.tobytes(), k=top.k, length=length
    )


def _targets(rows: Sequence[Sequence[float | None]]) -> pb.Tensor:
    """``[len(prompt) - 1, K]`` float32, 0.0 where the request named no id: sparse CSR of the
    named cells where that is smaller (the rule of the SDK's ``TensorData.from_torch_sparse``,
    so a CSR request built by it gets a CSR answer of its very cells), else dense."""
    width = len(rows[0]) if rows else 0
    named = [(r, c, v) for r, row in enumerate(rows) for c, v in enumerate(row) if v is not None]
    shape = [len(rows), width]
    if len(rows) + 1 + 2 * len(named) >= len(rows) * width:
        dense = np.array([[0.0 if v is None else v for v in row] for row in rows], np.float32)
        return pb.Tensor(dense=dense.tobytes(), dtype=pb.DTYPE_FLOAT32, shape=shape)
    crow = np.zeros(len(rows) + 1, dtype=np.int64)
    for r, _, _ in named:
        crow[r + 1] += 1
    csr = pb.SparseCsr(
        values=np.array([v for _, _, v in named], dtype=np.float32).tobytes(),
        crow_indices=np.cumsum(crow).astype(np.int64).tobytes(),
        col_indices=np.array([c for _, c, _ in named], dtype=np.int64).tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=shape)


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
    stop_strings: tuple[str, ...] = ()
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    # ``[len(prompt) - 1, K]`` ids, -1 where none is asked (a CSR request's unlisted cells).
    target_prompt_logprobs: tuple[tuple[int, ...], ...] | None = None


UNSUPPORTED_SAMPLE_OPTIONS = ("prompt_alt_tokens_k",)


# What one asample may ask for, checked here because the route logs the request right after
# decoding it: a request the engine would refuse for its size never reaches the log. These are
# the engine's SamplingLimits defaults (a test keeps them equal; the front imports nothing of the
# engine). The model's positions are the engine's to check: the codec does not know the model.
MAX_SAMPLES = 64
MAX_SAMPLE_TOKENS = 4096  # max_tokens
MAX_PROMPT_TOKENS = 32768
MAX_SAMPLE_POSITIONS = 64 * 4096  # num_samples x (prompt + max_tokens): what decoding holds
MAX_STOP_TOKENS = 1024
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32
MAX_LOGPROB_IDS = 20  # a top-k width, target ids a prompt position
MAX_SEED = 2**63 - 1


def decode_sample(body: Mapping[str, Any]) -> SampleCall:
    """A JSON ``SampleRequest`` with every setting within its bound; options this server
    cannot honour are refused, never ignored. InvalidArgument naming every problem at once."""
    problems = [f"{name} is not supported" for name in UNSUPPORTED_SAMPLE_OPTIONS if body.get(name)]
    sampling_session_id = get_str(body, "sampling_session_id") or ""
    if not sampling_session_id:
        problems.append("sampling_session_id is missing: create a sampling session first")
    params = get_dict(body, "sampling_params") or {}
    stop, stop_strings = _stops(params.get("stop"), problems)
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
        temperature=get_setting(params, "temperature", 1.0),
        top_p=get_setting(params, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # the SDK's -1 is trainwire's 0: keep every token
        stop_tokens=stop,
        seed=get_int(params, "seed"),
        prompt_logprobs=get_bool(body, "prompt_logprobs"),
        stop_strings=stop_strings,
        topk_prompt_logprobs=_int(body, "topk_prompt_logprobs", 0),
        topk_sample_logprobs=_int(body, "topk_sample_logprobs", 0),
        prompt_logprobs_last_n=get_int(body, "prompt_logprobs_last_n"),
        target_prompt_logprobs=_target_ids(body.get("target_prompt_logprobs"), problems),
    )
    if max_tokens is not None:
        problems += _sample_bounds(call, top_k)
        problems += _logprob_bounds(call)
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
    problems += _stop_string_bounds(call.stop_strings)
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


def _logprob_bounds(call: SampleCall) -> list[str]:
    """The logprob options against their bounds and the prompt (the engine's ``PromptScoring``
    checks, bar the vocabulary, which only the engine knows)."""
    problems = [
        f"{name} must be in [0, {MAX_LOGPROB_IDS}], got {value}"
        for name, value in (
            ("topk_prompt_logprobs", call.topk_prompt_logprobs),
            ("topk_sample_logprobs", call.topk_sample_logprobs),
        )
        if not 0 <= value <= MAX_LOGPROB_IDS
    ]
    scored = len(call.prompt) - 1  # the prompt's tokens after the first
    last_n = call.prompt_logprobs_last_n
    if last_n is not None and not call.prompt_logprobs:
        problems.append("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
    if last_n is not None and not 1 <= last_n <= scored:
        problems.append(f"prompt_logprobs_last_n must be in [1, {scored}], got {last_n}")
    targets = call.target_prompt_logprobs
    if targets is not None:
        if len(targets) != scored:
            problems.append(
                f"target_prompt_logprobs has {len(targets)} rows; the prompt's tokens after the "
                f"first are {scored}"
            )
        elif targets and not 1 <= len(targets[0]) <= MAX_LOGPROB_IDS:
            problems.append(
                f"target_prompt_logprobs rows must hold 1 to {MAX_LOGPROB_IDS} ids, got "
                f"{len(targets[0])}"
            )
        elif all(token == -1 for row in targets for token in row):
            problems.append("target_prompt_logprobs names no id (every cell is -1)")
    return problems


def _target_ids(value: Any, problems: list[str]) -> tuple[tuple[int, ...], ...] | None:
    """``target_prompt_logprobs``, the SDK's ``TensorData`` (int64, ``[rows, K]``, dense or
    sparse CSR), as dense rows of ids, -1 in a CSR tensor's unlisted cells. What is malformed
    goes to ``problems``."""
    if value is None:
        return None
    name = "target_prompt_logprobs"
    if not isinstance(value, dict):
        problems.append(f"{name} must be a tensor object, got {value!r:.40}")
        return None
    shape, data = value.get("shape"), value.get("data")
    if value.get("dtype") != "int64":
        problems.append(f"{name} must be an int64 tensor of token ids")
    elif not (
        isinstance(shape, list) and len(shape) == 2 and all(is_non_negative_int(n) for n in shape)
    ):
        problems.append(f"{name} must be 2-D, [len(prompt) - 1, K], got shape {shape!r:.40}")
    elif shape[0] > MAX_PROMPT_TOKENS or shape[1] > MAX_LOGPROB_IDS:
        problems.append(
            f"{name} has shape {shape}; at most [{MAX_PROMPT_TOKENS}, {MAX_LOGPROB_IDS}]"
        )
    elif not isinstance(data, list) or not all(_is_token_id_or_none(token) for token in data):
        problems.append(f"{name} must hold token ids in [0, {MAX_TOKEN_ID}] or -1 (none)")
    else:
        rows, width = shape
        if value.get("sparse_crow_indices") is None:
            if len(data) != rows * width:
                problems.append(f"{name} holds {len(data)} ids; its shape {shape} needs "
                                f"{rows * width}")  # fmt: skip
                return None
            return tuple(tuple(data[r * width : (r + 1) * width]) for r in range(rows))
        return _csr_ids(value, rows, width, problems)
    return None


def _csr_ids(
    value: Mapping[str, Any], rows: int, width: int, problems: list[str]
) -> tuple[tuple[int, ...], ...] | None:
    """A sparse CSR ``target_prompt_logprobs`` as dense rows, -1 where no cell is listed."""
    crow, cols, data = value["sparse_crow_indices"], value.get("sparse_col_indices"), value["data"]
    if (
        not isinstance(crow, list)
        or not isinstance(cols, list)
        or len(crow) != rows + 1
        or not all(is_non_negative_int(n) for n in [*crow, *cols])
        or crow[0] != 0
        or not crow[-1] == len(cols) == len(data)
        or any(crow[r] > crow[r + 1] for r in range(rows))
    ):
        problems.append(
            "target_prompt_logprobs: sparse_crow_indices and sparse_col_indices are not a CSR "
            "layout of its shape and data"
        )
        return None
    dense = [[-1] * width for _ in range(rows)]
    for r in range(rows):
        listed = cols[crow[r] : crow[r + 1]]
        if any(c >= width for c in listed) or listed != sorted(set(listed)):
            problems.append(
                f"target_prompt_logprobs: row {r} lists columns {listed!r:.40}; each must be "
                f"below {width}, once, in order"
            )
            return None
        for c, token in zip(listed, data[crow[r] : crow[r + 1]], strict=True):
            dense[r][c] = token
    return tuple(tuple(row) for row in dense)


def _is_token_id_or_none(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -1 <= value <= MAX_TOKEN_ID


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


def _stops(stop: Any, problems: list[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``sampling_params.stop`` as (token ids, strings): one string, a list of strings or a
    list of token ids, as the SDK types it. What this server cannot honour goes to
    ``problems``."""
    if isinstance(stop, str):
        return (), (stop,)
    if stop is not None and not isinstance(stop, list):
        problems.append(
            f"sampling_params.stop must be a string or a list of strings or of token ids, got "
            f"{stop!r:.40}"
        )
    elif stop is not None and len(stop) == 0:
        problems.append("stop=[] (no EOS stop) is not supported; give max_tokens instead")
    elif stop and all(isinstance(s, str) for s in stop):
        return (), tuple(stop)
    elif stop and not all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        problems.append(
            "sampling_params.stop must be all strings or all token ids, not a mix or other values"
        )
    else:
        return tuple(stop or ()), ()
    return (), ()


def _stop_string_bounds(stop_strings: Sequence[str]) -> list[str]:
    """The engine's stop-string limits (``SamplingLimits``), checked before the request is
    logged."""
    if len(stop_strings) > MAX_STOP_STRINGS:
        return [f"{len(stop_strings)} stop strings; at most {MAX_STOP_STRINGS}"]
    problems = []
    for index, text in enumerate(stop_strings):
        if not text:
            problems.append(f"sampling_params.stop[{index}] is an empty string: give a character")
        elif len(text) > MAX_STOP_STRING_CHARS:
            problems.append(
                f"sampling_params.stop[{index}] has {len(text)} characters; at most "
                f"{MAX_STOP_STRING_CHARS}"
            )
    return problems


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
