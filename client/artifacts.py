"""The files a finished run leaves in its work directory, the same for every runner:
``training_summary.json`` and ``.yaml``, ``metrics.jsonl`` and ``loss_curve.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwire.client.files import write_bytes_atomic, write_text_atomic
from trainwire.client.plan import ManagedTrainingPlan
from trainwire.client.results import TrainingResult

SUMMARY_JSON = "training_summary.json"
SUMMARY_YAML = "training_summary.yaml"
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss_curve.png"


def run_summary(
    result: TrainingResult, plan: ManagedTrainingPlan, **details: Any
) -> dict[str, Any]:
    """The summary: the run's identity, its config, its result and the final state digest."""
    return {
        "manifest_fingerprint": plan.fingerprint,
        "config_fingerprint": plan.config.fingerprint(),
        "config": plan.config.to_dict(),
        "batch_count": plan.batch_count,
        "max_steps": plan.max_steps,
        **details,
        "state_digest": result.state_digest,
        "result": result.to_dict(),
    }


def write_run_artifacts(
    directory: str | Path, result: TrainingResult, plan: ManagedTrainingPlan, **details: Any
) -> dict[str, Path]:
    """Write the summary (JSON and YAML), the metrics log and the curve picture."""
    import yaml

    out = Path(directory)
    summary = run_summary(result, plan, **details)
    paths = {
        "summary_json": out / SUMMARY_JSON,
        "summary_yaml": out / SUMMARY_YAML,
        "metrics": out / METRICS_FILE,
        "curve": out / CURVE_FILE,
    }
    write_text_atomic(paths["summary_json"], json.dumps(summary, indent=2, sort_keys=True))
    write_text_atomic(paths["summary_yaml"], yaml.safe_dump(summary, sort_keys=True))
    lines = "".join(json.dumps(record, sort_keys=True) + "\n" for record in result.history)
    write_text_atomic(paths["metrics"], lines)
    write_bytes_atomic(paths["curve"], loss_curve_png(result.history))
    return paths


def loss_curve_png(history: list[dict[str, Any]]) -> bytes:
    """Training loss per update, with evaluation metrics on a second axis."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    updates = [r for r in history if r["kind"] == "update"]
    evaluations = [r for r in history if r["kind"] == "evaluation"]
    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    axis.plot([r["step"] for r in updates], [r["loss"] for r in updates], label="train loss")
    if evaluations:
        axis.plot(
            [r["step"] for r in evaluations],
            [r["eval_loss"] for r in evaluations],
            "o-",
            label="eval loss",
        )
    axis.set_xlabel("update")
    axis.set_ylabel("loss")
    if evaluations and "eval_accuracy" in evaluations[0]:
        accuracy_axis = axis.twinx()
        accuracy_axis.plot(
            [r["step"] for r in evaluations],
            [r["eval_accuracy"] for r in evaluations],
            "s--",
            color="tab:green",
            label="eval accuracy",
        )
        accuracy_axis.set_ylabel("accuracy")
        accuracy_axis.set_ylim(0, 1)
        accuracy_axis.legend(loc="upper right")
    axis.legend(loc="upper left")
    axis.set_title("trainwire run")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
