"""The run's summary, written next to its outputs as ``training_summary.json`` and ``.yaml``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from trainwire.client.config import TrainingConfig
from trainwire.client.files import write_text_atomic
from trainwire.client.results import TrainingResult
from trainwire.server.training.hardware import HardwareInfo

SUMMARY_FORMAT = "trainwire.summary/v1"
SUMMARY_STEM = "training_summary"
SUMMARY_FORMATS = ("json", "yaml", "both")


def summary_dict(
    result: TrainingResult,
    config: TrainingConfig,
    hardware: HardwareInfo | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a summary holds: the final ``state_digest`` first, then the result, config and
    hardware; ``extra`` (JSON) adds run details such as the manifest fingerprint."""
    return {
        "format": SUMMARY_FORMAT,
        "state_digest": result.state_digest,
        **(extra or {}),
        "result": result.to_dict(),
        "config": config.to_dict(),
        "config_fingerprint": config.fingerprint(),
        "hardware": None if hardware is None else hardware.to_dict(),
    }


def save_training_summary(
    result: TrainingResult,
    config: TrainingConfig,
    hardware: HardwareInfo | None,
    output_dir: str | Path,
    format: str = "both",
    *,
    extra: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``training_summary.json`` and/or ``.yaml`` (``format``: json, yaml or both)
    atomically into ``output_dir``; returns the paths written."""
    if format not in SUMMARY_FORMATS:
        raise ValueError(
            f"summary format must be one of {', '.join(SUMMARY_FORMATS)}, got {format!r}"
        )
    text = json.dumps(summary_dict(result, config, hardware, extra), indent=2) + "\n"
    directory = Path(output_dir)
    written = []
    if format in ("json", "both"):
        path = directory / f"{SUMMARY_STEM}.json"
        write_text_atomic(path, text)
        written.append(path)
    if format in ("yaml", "both"):
        path = directory / f"{SUMMARY_STEM}.yaml"
        # The YAML is the JSON's content, read back, so both hold the same plain values.
        write_text_atomic(path, yaml.safe_dump(json.loads(text), sort_keys=False))
        written.append(path)
    return written
