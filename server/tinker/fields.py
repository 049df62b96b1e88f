"""Typed reads of the SDK's JSON bodies.

A field of the wrong type is the caller's mistake: INVALID_ARGUMENT (HTTP 400) naming the field
and what it must be, raised before any work, never a TypeError deep in the server. A missing
field or JSON null reads as ``default``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from trainwire.server.errors import InvalidArgument


def _refuse(name: str, expected: str, value: Any) -> InvalidArgument:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return InvalidArgument(f"{name} must be {expected}, got {shown}")


def get_str(body: Mapping[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _refuse(name, "a string", value)
    return value


def get_int(body: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(name, "an integer", value)
    return value


def get_float(body: Mapping[str, Any], name: str, default: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(name, "a number", value)
    if not math.isfinite(value):
        raise _refuse(name, "a finite number", value)
    return float(value)


def get_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _refuse(name, "true or false", value)
    return value


def get_dict(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _refuse(name, "an object", value)
    return value


def get_list(body: Mapping[str, Any], name: str) -> list[Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise _refuse(name, "a list", value)
    return value


def int_list(values: list[Any], name: str) -> list[int]:
    """Every item an integer (token ids)."""
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _refuse(f"every item of {name}", "an integer", value)
    return values
