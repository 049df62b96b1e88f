"""Typed requests as the ledger stores them: what a restart re-queues an accepted call from.

An accepted ordered call is stored as its operation's kind and its request: the typed request the
transport decoded (``requests``), not the transport's body. A restart takes the call back from
here with no transport decoding it again, so what the transport found when it accepted the call
(a checkpoint's folder, the run it was sent to) is what runs, whatever changed since.

Lossless: a token example's ids and floats are stored as the little-endian bytes of an array
(base64, tagged with its type), so the request read back equals the accepted one bit for bit,
and writing a large batch costs one copy, not a float's repr per value. Each array takes the
narrowest type that holds it exactly: ids int32 where they fit (a vocabulary's always do), else
int64; floats float32 where every value is one (whatever a client sent as float32, the SDK's
tensors and the gRPC contract's), else float64. Every other field is JSON as it is (Python
writes a float's shortest repr, which reads back exactly).
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

# Each array field's types, narrow then wide, as (the tag its stored text starts with, dtype).
Types = tuple[tuple[str, str], tuple[str, str]]
IDS: Types = (("i4", "<i4"), ("i8", "<i8"))
FLOATS: Types = (("f4", "<f4"), ("f8", "<f8"))
ARRAY_TYPES: dict[str, Types] = {
    **dict.fromkeys(TOKEN_FIELDS, IDS),
    **dict.fromkeys(FLOAT_FIELDS, FLOATS),
}


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


def _packed(values: Sequence[float], types: Types) -> str:
    """``values`` in the narrower of ``types`` where it holds every one exactly, else the wider,
    as ``tag:base64``."""
    narrow, wide = types
    array = np.asarray(values, dtype=wide[1])
    with np.errstate(over="ignore"):  # a value too large overflows: then it is not narrowed
        narrowed = array.astype(narrow[1])
    tag, array = (narrow[0], narrowed) if np.array_equal(narrowed, array) else (wide[0], array)
    return f"{tag}:{base64.b64encode(array.tobytes()).decode('ascii')}"


def _unpacked(text: str, types: Types) -> tuple[Any, ...]:
    tag, _, data = text.partition(":")
    dtypes = dict(types)
    if tag not in dtypes:
        raise ValueError(f"a stored array of type {tag!r}: one of {sorted(dtypes)}")
    return tuple(np.frombuffer(base64.b64decode(data), dtype=dtypes[tag]).tolist())
