"""What a run's progress says, in words that fit the terminal: pure text, no I/O.

The progress bar (``trainwire.client.control.progress_bar``) draws these strings; they live
apart so a test can ask what a line says at 80 or 120 columns without a terminal. The fields
come in order of what a user looks at first (how far, the loss, the held-out metric); the ones
that do not fit are left out whole, never cut in the middle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainwire.contract.run.progress import Progress

BAR_MIN_WIDTH = 10
BAR_MAX_WIDTH = 30
SEPARATOR = "  "
EVAL_PREFIX = "eval_"


def metric_name(key: str) -> str:
    """``eval_accuracy`` -> ``accuracy``: the prefix says where it was measured, which the
    line says once ("eval ...")."""
    return key[len(EVAL_PREFIX) :] if key.startswith(EVAL_PREFIX) else key


def format_value(value: float) -> str:
    """Four decimals: enough to see a loss move, short enough to read (1e-4 and 12345.6789
    alike stay readable; huge values switch to 4 significant digits)."""
    return f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4g}"


def evaluation_text(metrics: dict[str, float], first: str | None = None) -> str:
    """``eval accuracy 0.9844 loss 0.3461``: every ``eval_`` metric once, ``first`` leading
    (the metric that selects the best checkpoint, where known)."""
    keys = [k for k in metrics if k.startswith(EVAL_PREFIX)]
    if first in keys:
        keys.remove(first)
        keys.insert(0, first)
    return "eval " + " ".join(f"{metric_name(k)} {format_value(metrics[k])}" for k in keys)


def best_text(metric: str, score: float | None, step: int | None) -> str:
    """``best eval accuracy 0.6829 at step 72`` (or ``no evaluation`` when the run had none)."""
    if score is None:
        return "no evaluation"
    return f"best eval {metric_name(metric)} {format_value(score)} at step {step}"


def duration_text(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: an ETA, read at a glance."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class RateWindow:
    """Microbatches per second over the work done since the run (re)started here.

    A restart (this process resuming, or the controller resuming after an outage) opens a new
    window, so time spent waiting for a server is never counted as slow training.
    """

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.started_s = clock()
        self.start_done: int | None = None  # microbatches done when the window opened
        self.last_done = -1
        self.tokens = 0  # tokens of the microbatches done in the window

    def restart(self, done: int, at_s: float | None = None) -> None:
        self.started_s = self.clock() if at_s is None else at_s
        self.start_done = done
        self.tokens = 0

    def observe(self, progress: Progress) -> None:
        """Record a finished microbatch; a resume marker or a step back opens a new window."""
        done = progress.microbatch + 1
        resumed = progress.extra.get("resumed")
        if resumed is not None:
            self.restart(resumed["microbatch"], resumed["at_s"])
        elif self.start_done is None:
            # The first microbatch seen here: the window opens where it started, when this
            # reporter began waiting for it.
            self.restart(progress.microbatch, self.started_s)
        elif done <= self.last_done:
            self.restart(done)  # a replay from an earlier point: count from here on
            self.last_done = done
            return
        self.tokens += progress.tokens
        self.last_done = done

    def per_second(self) -> float:
        """Microbatches per second in the window (0 before there is one to count)."""
        return self._rate(self.last_done - (self.start_done or 0))

    def tokens_per_second(self) -> float:
        """Tokens per second in the window, where the runner reports tokens."""
        return self._rate(self.tokens)

    def _rate(self, amount: float) -> float:
        elapsed = self.clock() - self.started_s
        return amount / elapsed if elapsed > 0 and amount > 0 else 0.0


@dataclass(frozen=True)
class ProgressFields:
    """The words of one progress line, most important first."""

    done: int
    total: int
    step: int
    max_steps: int
    epoch: int
    loss: float
    evaluation: str = ""
    rate: float = 0.0
    tokens_per_s: float = 0.0

    def parts(self) -> list[str]:
        parts = [
            f"{self.done}/{self.total} microbatches",
            f"step {self.step}/{self.max_steps}",
            f"loss {format_value(self.loss)}",
        ]
        if self.evaluation:
            parts.append(self.evaluation)
        if self.rate > 0:
            parts.append(f"eta {duration_text((self.total - self.done) / self.rate)}")
            parts.append(f"{self.rate:.1f} microbatches/s")
        parts.append(f"epoch {self.epoch}")
        if self.tokens_per_s > 0:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        return parts

    def text(self) -> str:
        """Every field, for a log line (no width to fit)."""
        return SEPARATOR.join(self.parts())


def fit_parts(parts: list[str], width: int) -> str:
    """The parts, in order, that fit in ``width`` columns; a part that does not fit is left out
    whole (the eval metrics drop their later entries first)."""
    kept: list[str] = []
    for part in parts:
        candidate = SEPARATOR.join([*kept, part])
        if len(candidate) <= width:
            kept.append(part)
            continue
        if part.startswith("eval "):
            shorter = _shortest_eval_that_fits(part, kept, width)
            if shorter:
                kept.append(shorter)
    return SEPARATOR.join(kept)


def _shortest_eval_that_fits(part: str, kept: list[str], width: int) -> str:
    words = part.split(" ")  # "eval", name, value, name, value, ...
    for end in range(len(words) - 2, 1, -2):
        shorter = " ".join(words[:end])
        if len(SEPARATOR.join([*kept, shorter])) <= width:
            return shorter
    return ""


def bar_text(fraction: float, width: int) -> str:
    """A bar of ``width`` cells: full blocks for what is done, a thin rule for the rest."""
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "─" * (width - filled)


def progress_line(fields: ProgressFields, width: int) -> str:
    """One line of at most ``width - 1`` columns (the last column would wrap some terminals):
    a bar between BAR_MIN_WIDTH and BAR_MAX_WIDTH cells, then the fields that fit."""
    usable = max(width - 1, BAR_MIN_WIDTH + 1)
    text = fit_parts(fields.parts(), usable - BAR_MIN_WIDTH - 1)
    bar_width = min(BAR_MAX_WIDTH, usable - len(text) - 1)
    fraction = fields.done / fields.total if fields.total else 1.0
    return f"{bar_text(fraction, bar_width)} {text}"
