"""Typed reads of the SDK's JSON bodies.

A field of the wrong type is the caller's mistake: INVALID_ARGUMENT (HTTP 400) naming the field
and what it must be, raised before any work, never a TypeError deep in the server. A missing
field or JSON null reads as ``default``, except a float setting the SDK always writes
(``get_setting``: there null is a NaN or an infinity).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from trainwire.server.errors import InvalidArgument


def _wrong_type(name: str, expected: str, value: Any) -> InvalidArgument:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return InvalidArgument(f"{name} must be {expected}, got {shown}")


def _typed_field(
    body: Mapping[str, Any], name: str, default: Any, accepts: Callable[[Any], bool], what: str
) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not accepts(value):
        raise _wrong_type(name, what, value)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_non_negative_int(value: Any) -> bool:
    """An integer >= 0 (a count, a cursor, a clone id), never a bool."""
    return _is_int(value) and value >= 0


def _is_number(value: Any) -> bool:
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer past float's range
        return False


def get_str(body: Mapping[str, Any], name: str, default: str | None = None) -> str | None:
    return _typed_field(body, name, default, lambda v: isinstance(v, str), "a string")


def get_int(body: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    return _typed_field(body, name, default, _is_int, "an integer")


def get_float(body: Mapping[str, Any], name: str, default: float | None = None) -> float | None:
    value = _typed_field(body, name, default, _is_number, "a finite number")
    return None if value is None else float(value)


def get_setting(body: Mapping[str, Any], name: str, default: float) -> float:
    """A float setting the SDK always writes (``AdamParams``, ``SamplingParams``): missing
    reads as ``default``, but JSON null is refused. The SDK's encoder writes NaN and infinity as
    null, so a null there is a NaN the caller computed, never a request for the default (a
    scheduler's NaN learning rate silently trained at 1e-4)."""
    if name in body and body[name] is None:
        raise InvalidArgument(
            f"{name} must be a finite number, got null (the SDK sends NaN and infinity as null)"
        )
    value = get_float(body, name, default)
    return default if value is None else value


def get_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    return _typed_field(body, name, default, lambda v: isinstance(v, bool), "true or false")


def get_dict(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _typed_field(body, name, None, lambda v: isinstance(v, dict), "an object")


def get_list(body: Mapping[str, Any], name: str) -> list[Any] | None:
    return _typed_field(body, name, None, lambda v: isinstance(v, list), "a list")


def int_list(values: list[Any], name: str) -> list[int]:
    """Every item an integer (token ids)."""
    for value in values:
        if not _is_int(value):
            raise _wrong_type(f"every item of {name}", "an integer", value)
    return values
