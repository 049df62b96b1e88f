"""``key=value`` overrides from the command line, parsed into JSON-like values."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from typing import Any


def parse_override_value(text: str) -> Any:
    """bool (any case), int, float, JSON or Python literal (lists, dicts, null), else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_config_overrides(overrides: Iterable[str]) -> tuple[dict[str, Any], list[str]]:
    """Split each ``key=value`` on its first ``=``; items without one come back as invalid."""
    valid: dict[str, Any] = {}
    invalid: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            invalid.append(item)
            continue
        valid[key] = parse_override_value(value)
    return valid, invalid


def apply_overrides(config_dict: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply overrides to a config dict; ``lora.r=4`` reaches into the nested LoRA settings."""
    merged = dict(config_dict)
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        if dot:
            nested = merged.get(head)
            if not isinstance(nested, dict):
                nested = {}
            merged[head] = {**nested, rest: value}
        else:
            merged[key] = value
    return merged
