"""The loss-curve picture a finished run leaves (``loss_curve.png``): what a user opens first to
see whether the run learned and which checkpoint it kept.

Losses share the left axis; the other evaluation metrics (accuracy, ...) the right one, padded
so points at 0 or 1 stay off the frame. The legend sits below the plot, never over the first
updates; the kept (best) checkpoint is marked and labelled on the curve of the metric that
chose it. matplotlib is imported here only, when a picture is drawn.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.contract.report.progress_text import format_value, metric_name

LOSS_KEY = "eval_loss"


@dataclass(frozen=True)
class CurveLabels:
    """What the picture names: its title and the checkpoint the run kept.

    Attributes:
        title: names the run, its model and its task.
        metric: ``metric_for_best`` (the metric that chose the kept checkpoint).
        best_step: the update of the kept checkpoint (None: the run kept none).
        best_score: its metric's value.
    """

    title: str = "trainwire run"
    metric: str = LOSS_KEY
    best_step: int | None = None
    best_score: float | None = None

    @classmethod
    def of_run(
        cls,
        config: TrainingConfig,
        *,
        run_id: str | None = None,
        best_step: int | None = None,
        best_score: float | None = None,
    ) -> CurveLabels:
        model = Path(config.model).name or config.model
        title = f"{run_id}: {model} ({config.task})" if run_id else f"{model} ({config.task})"
        return cls(title, config.metric_for_best, best_step, best_score)


def loss_curve_png(history: list[dict[str, Any]], labels: CurveLabels | None = None) -> bytes:
    """Training loss per update, evaluation metrics per evaluation, the kept checkpoint."""
    from matplotlib import pyplot as plt

    figure = draw_loss_curve(history, labels or CurveLabels())
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def draw_loss_curve(history: list[dict[str, Any]], labels: CurveLabels) -> Any:
    """The picture as a matplotlib ``Figure`` (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    updates = [r for r in history if r["kind"] == "update"]
    evaluations = [r for r in history if r["kind"] == "evaluation"]
    others = sorted({k for r in evaluations for k in r if k.startswith("eval_")} - {LOSS_KEY})
    figure, loss_axis = plt.subplots(figsize=(8, 5), dpi=100, layout="constrained")
    loss_axis.plot([r["step"] for r in updates], [r["loss"] for r in updates], label="train loss")
    axes = {LOSS_KEY: loss_axis}
    if any(LOSS_KEY in r for r in evaluations):
        _plot_metric(loss_axis, evaluations, LOSS_KEY, "o-", "tab:orange")
    if others:
        metric_axis = loss_axis.twinx()
        for key, color in zip(others, ("tab:green", "tab:purple", "tab:brown"), strict=False):
            _plot_metric(metric_axis, evaluations, key, "s--", color)
            axes[key] = metric_axis
        metric_axis.set_ylabel(", ".join(metric_name(k) for k in others))
        _pad(metric_axis, [r[k] for r in evaluations for k in others if k in r])
    _mark_kept(axes.get(labels.metric), labels)
    loss_axis.set(xlabel="update (optimizer step)", ylabel="loss")
    loss_axis.margins(x=0.03)
    handles = [h for axis in figure.axes for h in axis.get_legend_handles_labels()[0]]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3))
    figure.suptitle(labels.title)
    loss_axis.set_title(f"kept checkpoint chosen by eval {metric_name(labels.metric)}", fontsize=9)
    return figure


def _plot_metric(axis: Any, evaluations: list[dict[str, Any]], key: str, style: str, color: str):
    points = [(r["step"], r[key]) for r in evaluations if key in r]
    axis.plot(*zip(*points, strict=True), style, color=color, label=f"eval {metric_name(key)}")


def _pad(axis: Any, values: list[float]) -> None:
    """A metric within [0, 1] gets the whole range plus a margin, so 0 and 1 sit inside."""
    if values and min(values) >= 0.0 and max(values) <= 1.0:
        axis.set_ylim(-0.05, 1.05)
    else:
        axis.margins(y=0.08)


def _mark_kept(axis: Any, labels: CurveLabels) -> None:
    """A star on the kept checkpoint's evaluation, and a dotted line down to its update."""
    if axis is None or labels.best_step is None or labels.best_score is None:
        return
    text = (
        f"kept checkpoint: step {labels.best_step}, "
        f"eval {metric_name(labels.metric)} {format_value(labels.best_score)}"
    )
    axis.axvline(labels.best_step, color="grey", linestyle=":", linewidth=1)
    axis.plot(
        [labels.best_step], [labels.best_score], "*", color="crimson", markersize=16, label=text
    )
