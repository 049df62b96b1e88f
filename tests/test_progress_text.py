"""What the progress view of a run says: it fits the terminal, names what it shows, and counts
its rate over the work done since the run (re)started."""

from __future__ import annotations

import io
import logging
import re

import pytest

from trainwire.client.control.progress_bar import ProgressReporter
from trainwire.contract.report.progress_text import (
    ProgressFields,
    RateWindow,
    best_text,
    duration_text,
    evaluation_text,
    progress_line,
)
from trainwire.contract.run.progress import Progress

EVALUATION = {"eval_loss": 0.34612, "eval_accuracy": 0.984375, "epoch": 5}


def busy_fields(**overrides: object) -> ProgressFields:
    values = {
        "done": 93,
        "total": 96,
        "step": 92,
        "max_steps": 96,
        "epoch": 5,
        "loss": 0.36238,
        "evaluation": evaluation_text(EVALUATION, "eval_accuracy"),
        "rate": 39.07,
        "tokens_per_s": 4681.2,
    }
    return ProgressFields(**{**values, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize("width", [80, 120])
def test_a_progress_line_fits_the_terminal_and_keeps_its_bar(width: int) -> None:
    line = progress_line(busy_fields(), width)
    assert len(line) < width
    bar = line.split(" ", 1)[0]
    assert len(bar) >= 10 and set(bar) <= {"█", "─"}
    assert "93/96 microbatches" in line and "loss 0.3624" in line
    assert "eval accuracy 0.9844" in line  # the selection metric, named, never cut


def test_a_wide_terminal_shows_every_field_in_words() -> None:
    line = progress_line(busy_fields(), 120)
    assert "eval accuracy 0.9844 loss 0.3461" in line  # "eval" once, not eval=eval_loss
    assert "39.1 microbatches/s" in line and "mb/s" not in line
    assert "eta 0s" in line
    assert "epoch 5" in progress_line(busy_fields(evaluation=""), 120)


def test_fields_that_do_not_fit_are_left_out_whole() -> None:
    line = progress_line(busy_fields(), 60)
    words = line.split("  ")
    assert all(word in busy_fields().text() or word.startswith("█") for word in words)
    assert "accurac" not in line or "accuracy 0.9844" in line


def test_the_best_line_names_its_metric_and_rounds() -> None:
    assert best_text("eval_accuracy", 0.6829097867012024, 72) == (
        "best eval accuracy 0.6829 at step 72"
    )
    assert best_text("eval_loss", None, None) == "no evaluation"


def test_durations_read_at_a_glance() -> None:
    assert [duration_text(s) for s in (4.4, 185, 3720)] == ["4s", "3m05s", "1h02m"]


def progress(microbatch: int, **extra: object) -> Progress:
    return Progress(microbatch, 96, 0, microbatch + 1, 96, 0.5, tokens=10, extra=dict(extra))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_counts_the_work_since_the_last_start_not_the_outage() -> None:
    clock = Clock()
    window = RateWindow(clock)
    for i in range(10):  # 10 microbatches in 5 s
        clock.now += 0.5
        window.observe(progress(i))
    assert window.per_second() == 2.0
    clock.now += 600  # the server was down for ten minutes; the run resumes at microbatch 8
    resumed = {"microbatch": 8, "at_s": clock.now}
    clock.now += 0.25
    window.observe(progress(8, resumed=resumed))
    clock.now += 0.25
    window.observe(progress(9))
    assert window.per_second() == 4.0  # two microbatches in the half second since the resume
    assert window.tokens_per_second() == 40.0  # and their tokens


def test_a_resumed_process_counts_only_its_own_microbatches() -> None:
    clock = Clock()
    window = RateWindow(clock)
    clock.now += 2.0
    window.observe(progress(40))  # the first microbatch this process ran: the 41st
    assert window.per_second() == 0.5


def test_without_a_terminal_the_reporter_writes_plain_lines() -> None:
    stream = io.StringIO()
    reporter = ProgressReporter(stream=stream, log_every=1, metric="eval_accuracy")
    update = {"loss": 0.25}
    reporter(Progress(0, 96, 0, 1, 96, 0.25, update=update, evaluation=EVALUATION))
    reporter.close()
    line = stream.getvalue().strip()
    assert line.startswith("1/96 microbatches  step 1/96  loss 0.2500  eval accuracy 0.9844")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("width", [80, 120])
def test_on_a_terminal_every_drawn_line_fits_and_logs_print_above(width: int) -> None:
    stream = Terminal()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        reporter = ProgressReporter(stream=stream, metric="eval_accuracy", width=width)
        for i in range(20):
            evaluation = EVALUATION if i == 9 else None
            reporter(
                Progress(i, 96, 0, i + 1, 96, 0.5, update={"loss": 0.5}, evaluation=evaluation)
            )
            if i == 10:
                logging.getLogger("trainwire.client.control.controller").warning(
                    "server unreachable"
                )
        reporter.close()
    finally:
        root.removeHandler(handler)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())
    lines = [line for line in re.split(r"[\r\n]+", screen) if line.strip()]
    assert all(len(line) < width for line in lines), [len(line) for line in lines]
    assert "server unreachable" in lines  # a line of its own, not glued to the bar
    assert "20/96 microbatches" in lines[-1]
    assert "eval accuracy 0.9844" in lines[-1]
