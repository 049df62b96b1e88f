"""``key=value`` overrides from the command line, parsed into JSON-like values.

``checked_config_overrides`` is the one place a ``--set`` list is checked; every command that
takes one (plan, train, serve) calls it, so all refuse a bad item with the same words.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.contract.config_keys import CONFIG_ALIASES, LORA_ALIASES, with_trainwire_names


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


def parse_config_overrides(
    overrides: Iterable[str] | None,
) -> tuple[dict[str, Any], list[str]]:
    """Parse ``key=value`` strings into ``(valid_overrides, invalid_strings)``.

    Each item splits on its first ``=`` (so a value may hold ``=``); its value is parsed by
    ``parse_override_value``. Items without ``=`` or without a key come back in the invalid
    list, for the caller to report. None (no overrides given) gives ``({}, [])``.

    Example:
        >>> parse_config_overrides(["learning_rate=1e-4", "invalid", "batch_size=32"])
        ({'learning_rate': 0.0001, 'batch_size': 32}, ['invalid'])
    """
    valid: dict[str, Any] = {}
    invalid: list[str] = []
    for item in overrides or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            invalid.append(item)
            continue
        valid[key] = parse_override_value(value)
    return valid, invalid


def checked_config_overrides(
    overrides: Iterable[str] | None, *, option: str = "--set"
) -> dict[str, Any]:
    """The valid overrides; any item that is not ``key=value`` raises one ``ValueError``
    naming them all (``--set takes key=value, got: a, b``). The one check every command that
    takes ``--set`` uses."""
    valid, invalid = parse_config_overrides(overrides)
    if invalid:
        raise ValueError(f"{option} takes key=value, got: {', '.join(invalid)}")
    return valid


def config_with_overrides(
    config_dict: dict[str, Any], overrides: Iterable[str] | None, *, option: str = "--set"
) -> TrainingConfig:
    """``config_dict`` with the ``key=value`` overrides applied, as a validated config.

    Raises ``ValueError`` for an item that is not ``key=value`` and (``TrainingConfig.from_dict``)
    for an unknown key or a bad value.
    """
    valid = checked_config_overrides(overrides, option=option)
    return TrainingConfig.from_dict(apply_overrides(config_dict, valid))


def apply_overrides(config_dict: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply overrides to a config dict; ``lora.r=4`` reaches into the nested LoRA settings.

    Hugging Face names count as trainwire's on both sides, so ``--set num_train_epochs=3``
    replaces a file's ``num_epochs`` rather than clashing with it."""
    merged = with_trainwire_names(config_dict, CONFIG_ALIASES)
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        head = CONFIG_ALIASES.get(head, head)
        if dot:
            nested = merged.get(head)
            if not isinstance(nested, dict):
                nested = {}
            nested = with_trainwire_names(nested, LORA_ALIASES, prefix="lora.")
            rest = LORA_ALIASES.get(rest, rest) if head == "lora" else rest
            merged[head] = {**nested, rest: value}
        else:
            merged[head] = value
    return merged
