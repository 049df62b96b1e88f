"""Typed requests as the ledger stores them: what a restart re-queues an accepted call from.

An accepted ordered call is stored as its operation's kind and its request: the typed request the
transport decoded (``requests``), not the transport's body. A restart takes the call back from
here with no transport decoding it again, so what the transport found when it accepted the call
(a checkpoint's folder, the run it was sent to) is what runs, whatever changed since.

Lossless: a token example's ids and floats are stored as the little-endian bytes of int64 and
float64 arrays (base64), so the request read back equals the accepted one bit for bit, and
writing a large batch costs one copy, not a float's repr per value. Every other field is JSON as
it is (Python writes a float's shortest repr, which reads back exactly).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainwire.contract.config import InputExample
from trainwire.contract.outcomes import WeightsSource
from trainwire.contract.tokens import FLOAT_FIELDS, TOKEN_FIELDS, TokenExample

ARRAY_TYPES = {**dict.fromkeys(TOKEN_FIELDS, "<i8"), **dict.fromkeys(FLOAT_FIELDS, "<f8")}


def request_body(request: Any) -> dict[str, Any]:
    """``request`` (a dataclass of ``requests``) as JSON: each field by name."""
    body: dict[str, Any] = {}
    for field in dataclasses.fields(request):
        value = getattr(request, field.name)
        if field.name == "examples":
            value = [_example_body(example) for example in value]
        elif isinstance(value, WeightsSource):
            value = {"kind": value.kind, "value": value.value}
        elif isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        body[field.name] = value
    return body


def request_of(request_type: type[Any], body: Any) -> Any:
    """The ``request_type`` request ``body`` holds; ValueError when it holds none."""
    what = f"a stored {request_type.__name__}"
    if not isinstance(body, dict):
        raise ValueError(f"{what} must be an object, got {body!r:.80}")
    fields = dict(body)
    try:
        if "examples" in fields:
            fields["examples"] = tuple(_example_of(example) for example in fields["examples"])
        if isinstance(fields.get("source"), dict):
            fields["source"] = WeightsSource(**fields["source"])
        return request_type(**fields)
    except (TypeError, ValueError, binascii.Error) as error:
        raise ValueError(f"{what}: {error}") from None


def _example_body(example: InputExample | TokenExample) -> dict[str, Any]:
    if isinstance(example, InputExample):
        return example.to_dict()
    arrays = {name: getattr(example, name) for name in ARRAY_TYPES}
    return {name: _packed(values, ARRAY_TYPES[name]) for name, values in arrays.items() if values}


def _example_of(body: dict[str, Any]) -> InputExample | TokenExample:
    if "text" in body:
        return InputExample(**body)
    unknown = sorted(set(body) - set(ARRAY_TYPES))
    if unknown:
        raise ValueError(f"a stored token example has unknown fields {unknown}")
    return TokenExample(**{name: _unpacked(text, ARRAY_TYPES[name]) for name, text in body.items()})


def _packed(values: Sequence[float], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def _unpacked(text: str, dtype: str) -> tuple[Any, ...]:
    return tuple(np.frombuffer(base64.b64decode(text), dtype=dtype).tolist())
