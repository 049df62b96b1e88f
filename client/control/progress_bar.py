"""A live progress view of a run: one line redrawn in place on a terminal, a log line otherwise.

The words come from ``trainwire.contract.report.progress_text`` and always fit the terminal's width
(fields that do not fit are left out whole). On a terminal the line is a ``rich`` live display,
and log records written meanwhile print above it instead of breaking it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from trainwire.contract.report.progress_text import (
    ProgressFields,
    RateWindow,
    evaluation_text,
    progress_line,
)
from trainwire.contract.run.progress import Progress

logger = logging.getLogger(__name__)


class ProgressReporter:
    """An ``on_step`` callback: microbatches done, step, loss, the latest eval metrics, epoch,
    microbatches per second and ETA (since this run last started), tokens per second.

    ``quiet`` prints nothing; without a terminal it writes one line every ``log_every`` updates
    and after every evaluation. ``metric`` (the run's ``metric_for_best``) leads the eval
    metrics; ``width`` fixes the line's width (default: the terminal's).
    """

    def __init__(
        self,
        *,
        quiet: bool = False,
        log_every: int = 10,
        stream: Any = None,
        metric: str | None = None,
        width: int | None = None,
    ) -> None:
        self.quiet = quiet
        self.log_every = log_every
        self.stream = stream or sys.stderr
        self.metric = metric
        self.width = width
        self.rate = RateWindow()
        self.evaluation = ""
        self.live: Any = None
        self._moved_handlers: list[logging.StreamHandler[Any]] = []

    def __call__(self, progress: Progress) -> None:
        if self.quiet:
            return
        self.rate.observe(progress)
        if progress.evaluation is not None:
            self.evaluation = evaluation_text(progress.evaluation, self.metric)
        if self._is_terminal():
            self._draw(progress)
        elif progress.update is not None and (
            progress.step % self.log_every == 0 or progress.evaluation is not None
        ):
            self.stream.write(self.fields(progress).text() + "\n")
            self.stream.flush()

    def fields(self, progress: Progress) -> ProgressFields:
        """What the line says about ``progress`` (the update's loss where one followed)."""
        loss = progress.update["loss"] if progress.update is not None else progress.loss
        return ProgressFields(
            done=progress.microbatch + 1,
            total=progress.batch_count,
            step=progress.step,
            max_steps=progress.max_steps,
            epoch=progress.epoch,
            loss=loss,
            evaluation=self.evaluation,
            rate=self.rate.per_second(),
            tokens_per_s=self.rate.tokens_per_second(),
        )

    def line(self, progress: Progress, width: int) -> str:
        return progress_line(self.fields(progress), width)

    def _is_terminal(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def _draw(self, progress: Progress) -> None:
        from rich.text import Text

        if self.live is None:
            self._start_live()
        width = self.width or self.live.console.width
        self.live.update(Text(self.line(progress, width), no_wrap=True, overflow="crop"))

    def _start_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self.stream, width=self.width)
        # Redrawn a few times a second, whatever the microbatch rate: a fast run would
        # otherwise spend its time writing to the terminal.
        self.live = Live(console=console, refresh_per_second=8, transient=False)
        self.live.start()
        # Log records go through the live display, so they print above the line.
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                handler.setStream(_LiveStream(self.live))
                self._moved_handlers.append(handler)

    def close(self) -> None:
        if self.live is None:
            return
        self.live.stop()  # draws the last state once more
        for handler in self._moved_handlers:
            handler.setStream(self.stream)
        self._moved_handlers.clear()
        self.live = None


class _LiveStream:
    """A text stream whose lines print above a live display (what rich's own stdout
    redirection does, for a logging handler that holds its stream)."""

    def __init__(self, live: Any) -> None:
        self.live = live
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        if "\n" in self.pending:
            lines, self.pending = self.pending.rsplit("\n", 1)
            self.live.console.print(lines, markup=False, highlight=False, soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.live.console.print(self.pending, markup=False, highlight=False, soft_wrap=True)
            self.pending = ""
