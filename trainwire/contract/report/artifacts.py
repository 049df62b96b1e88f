"""The files a finished run leaves in its directory, the same for every runner:
``training_summary.json`` and ``.yaml``, ``metrics.jsonl`` and ``loss_curve.png``.

One writer and one summary schema serve them all: the controller and ManagedTraining's callers
(``write_run_artifacts``), ``trainwire train`` and the seed's ``save_training_summary`` in
``trainwire.server.training``. It lives here, torch-free, so the controller never imports torch
or Lightning; the hardware a local run detected is an optional part of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.contract.files import write_bytes_atomic, write_text_atomic
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.report.loss_curve import CurveLabels, loss_curve_png
from trainwire.contract.run.results import TrainingResult

SUMMARY_FORMAT = "trainwire.summary/v1"
SUMMARY_STEM = "training_summary"
SUMMARY_JSON = SUMMARY_STEM + ".json"
SUMMARY_YAML = SUMMARY_STEM + ".yaml"
SUMMARY_FORMATS = ("json", "yaml", "both")
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss_curve.png"
__all__ = ["CURVE_FILE", "loss_curve_png", "run_summary", "write_run_artifacts", "write_summary"]


def run_summary(
    result: TrainingResult,
    config: TrainingConfig,
    *,
    plan: ManagedTrainingPlan | None = None,
    hardware: Mapping[str, Any] | None = None,
    **details: Any,
) -> dict[str, Any]:
    """The summary, in one schema for every runner, in this order:

    ``format``; ``state_digest`` (the final one: equal digests, equal runs); the config's
    fingerprint and, given the plan, the manifest's fingerprint, its microbatches and updates;
    ``details`` (JSON: the runner, the run id, where the export went, ...); ``hardware`` (what
    a local run detected, None where it is not known on this side); ``config``; ``result``.
    """
    summary: dict[str, Any] = {
        "format": SUMMARY_FORMAT,
        "state_digest": result.state_digest,
        "config_fingerprint": config.fingerprint(),
    }
    if plan is not None:
        summary["manifest_fingerprint"] = plan.fingerprint
        summary["batch_count"] = plan.batch_count
        summary["max_steps"] = plan.max_steps
    summary.update(details)
    summary["hardware"] = None if hardware is None else dict(hardware)
    summary["config"] = config.to_dict()
    summary["result"] = result.to_dict()
    return summary


def write_summary(
    directory: str | Path, summary: Mapping[str, Any], format: str = "both"
) -> dict[str, Path]:
    """Write ``training_summary.json`` and/or ``.yaml`` (``format``: json, yaml or both)
    atomically into ``directory``; returns format to path."""
    if format not in SUMMARY_FORMATS:
        raise ValueError(
            f"summary format must be one of {', '.join(SUMMARY_FORMATS)}, got {format!r}"
        )
    import yaml

    out = Path(directory)
    text = json.dumps(summary, indent=2) + "\n"
    written: dict[str, Path] = {}
    if format in ("json", "both"):
        written["json"] = out / SUMMARY_JSON
        write_text_atomic(written["json"], text)
    if format in ("yaml", "both"):
        written["yaml"] = out / SUMMARY_YAML
        # The YAML is the JSON's content read back, so both hold the same plain values.
        write_text_atomic(written["yaml"], yaml.safe_dump(json.loads(text), sort_keys=False))
    return written


def write_run_artifacts(
    directory: str | Path,
    result: TrainingResult,
    plan: ManagedTrainingPlan,
    *,
    hardware: Mapping[str, Any] | None = None,
    **details: Any,
) -> dict[str, Path]:
    """Write the summary (JSON and YAML), the metrics log and the curve picture.

    Returns the paths by kind: ``json``, ``yaml`` (the summary), ``metrics``, ``curve``.
    """
    out = Path(directory)
    summary = run_summary(result, plan.config, plan=plan, hardware=hardware, **details)
    paths = write_summary(out, summary)
    paths["metrics"] = out / METRICS_FILE
    paths["curve"] = out / CURVE_FILE
    lines = "".join(json.dumps(record, sort_keys=True) + "\n" for record in result.history)
    write_text_atomic(paths["metrics"], lines)
    labels = CurveLabels.of_run(
        plan.config,
        run_id=details.get("run_id"),
        best_step=result.best_step,
        best_score=result.best_score,
    )
    write_bytes_atomic(paths["curve"], loss_curve_png(result.history, labels))
    return paths
