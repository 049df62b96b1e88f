"""The loss-curve picture names its run and metric, keeps its legend off the data, pads the
metric axis and marks the checkpoint the run kept."""

from __future__ import annotations

from typing import Any

import pytest
from matplotlib import pyplot as plt

from trainwire.contract.config import TrainingConfig
from trainwire.contract.report.loss_curve import CurveLabels, draw_loss_curve, loss_curve_png


def history() -> list[dict[str, Any]]:
    updates = [{"kind": "update", "step": s, "loss": 0.7 - 0.004 * s} for s in range(1, 97)]
    evaluations = [
        {"kind": "evaluation", "step": s, "eval_loss": 0.7 - 0.004 * s, "eval_accuracy": a}
        for s, a in ((16, 0.5), (48, 0.73), (80, 1.0), (96, 1.0))
    ]
    return sorted(updates + evaluations, key=lambda r: (r["step"], r["kind"] == "evaluation"))


@pytest.fixture
def figure():
    config = TrainingConfig(
        model="models/tiny-bert", task="sequence-classification", labels=("neg", "pos")
    )
    config = config.replace(metric_for_best="eval_accuracy", eval_strategy="epoch")
    labels = CurveLabels.of_run(config, run_id="demo", best_step=80, best_score=1.0)
    figure = draw_loss_curve(history(), labels)
    figure.canvas.draw()
    yield figure
    plt.close(figure)


def test_the_title_names_the_run_the_model_and_the_selection_metric(figure) -> None:
    assert figure.get_suptitle() == "demo: tiny-bert (sequence-classification)"
    assert "eval accuracy" in figure.axes[0].get_title()


def test_the_legend_sits_outside_the_plot(figure) -> None:
    (legend,) = figure.legends
    legend_box = legend.get_window_extent()
    plot_box = figure.axes[0].get_window_extent()
    assert legend_box.y1 <= plot_box.y0  # below the axes: it covers no data


def test_accuracy_points_sit_inside_the_frame(figure) -> None:
    low, high = figure.axes[1].get_ylim()
    assert low < 0.0 and high > 1.0


def test_the_kept_checkpoint_is_marked_and_labelled(figure) -> None:
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert "kept checkpoint: step 80, eval accuracy 1.0000" in labels


def test_the_picture_is_a_png() -> None:
    assert loss_curve_png(history()).startswith(b"\x89PNG")
