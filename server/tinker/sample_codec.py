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

from trainwire.contract.outcomes import Sample
from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker.fields import (
    get_bool,
    get_dict,
    get_float,
    get_int,
    get_list,
    get_str,
    int_list,
)


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
    stop_strings: tuple[str, ...] = ()


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
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
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
        temperature=_float(params, "temperature", 1.0),
        top_p=_float(params, "top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # the SDK's -1 is trainwire's 0: keep every token
        stop_tokens=stop,
        seed=get_int(params, "seed"),
        prompt_logprobs=get_bool(body, "prompt_logprobs"),
        stop_strings=stop_strings,
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
