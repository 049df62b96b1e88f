"""TensorBoard event files of a run's history, written as it trains (``--tensorboard``).

``trainwire run`` and ``trainwire train`` write them under ``tensorboard/`` in the directory
that gets ``metrics.jsonl``, with the same figures at the same steps: each update's loss,
learning rate and gradient norm, each evaluation's metrics, under the tags Hugging Face's
Trainer uses (``train/loss``, ``train/learning_rate``, ``train/grad_norm``, ``eval/loss``,
``eval/accuracy``), at the update count the record carries (its ``step``).

Values are written by the package's own ``tensorboard.summary.Writer``, as float32: TensorBoard's
data server (what ``tensorboard --logdir`` loads with by default) shows no float64 scalar, so each
value is ``metrics.jsonl``'s rounded to the nearest float32, and nothing else.

A resumed run opens a new event file in the same directory (TensorBoard reads a directory's files
in the order of their names, which begin with the second the file was opened: a resume in the
second its killed run opened its file waits for the next, so its file sorts after) and writes
only steps the files do not hold yet: a replay after a crash runs records
again that the files already have, and a killed process may have lost records that its run's
history still holds, so each tag goes on from the last step the files hold. Steps of one tag
never repeat: a run's updates count up, and an evaluation follows an update.

Torch-free (the controller uses it); the ``tensorboard`` package is imported only when asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainwire.contract.run.history import UPDATE, record_figures

TENSORBOARD_DIR = "tensorboard"
EXTRA = "pip install 'trainwire[tensorboard]'"


class TensorBoardNotInstalled(ValueError):
    """``--tensorboard`` on an installation without the ``tensorboard`` package: the user's to
    fix with the extra, told in one line before anything starts."""


def require_tensorboard() -> None:
    """Refuse at once, naming the extra to install, when the ``tensorboard`` package is missing."""
    try:
        import tensorboard.summary  # noqa: F401
    except ImportError:
        raise TensorBoardNotInstalled(
            f"--tensorboard needs the tensorboard package: {EXTRA}"
        ) from None


def scalar_tags(record: dict[str, Any]) -> dict[str, float]:
    """A history record's figures by TensorBoard tag: an update's under ``train/``, an
    evaluation's under ``eval/`` (``eval_loss`` is ``eval/loss``), as Hugging Face's Trainer
    names them."""
    prefix = "train/" if record["kind"] == UPDATE else "eval/"
    return {
        prefix + name.removeprefix("eval_"): value for name, value in record_figures(record).items()
    }


class TensorBoardLog:
    """Follows a run's history into event files under ``directory``.

    ``follow(history)`` writes the records added since the last call (all of them on the
    first), skipping a tag's steps the directory already holds, and flushes, so TensorBoard
    shows each update as it lands and a killed run loses nothing its history keeps. The event
    file is opened at the first write, so a run that writes nothing leaves no empty file.
    """

    def __init__(self, directory: str | Path) -> None:
        require_tensorboard()
        self.directory = Path(directory)
        self._last_steps = last_steps(self.directory)
        self._followed = 0  # records of the history already looked at
        self._writer: Any = None

    def follow(self, history: Sequence[dict[str, Any]]) -> None:
        """Write what ``history`` added since the last call; a history that was taken back to
        an earlier point (a resynchronized run) repeats records already looked at, and only
        its new ones are written."""
        written = 0
        for record in history[self._followed :]:
            written += self._write(record)
        self._followed = max(self._followed, len(history))
        if written:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, record: dict[str, Any]) -> int:
        step, written = record["step"], 0
        for tag, value in scalar_tags(record).items():
            if step > self._last_steps.get(tag, -1):
                self._open().add_scalar(tag, value, step)
                self._last_steps[tag] = step
                written += 1
        return written

    def _open(self) -> Any:
        if self._writer is None:
            from tensorboard.summary import Writer

            _after_the_newest_file(self.directory)
            self._writer = Writer(str(self.directory))
        return self._writer


def _after_the_newest_file(directory: Path) -> None:
    """Wait, if need be, until a file opened now sorts after every event file ``directory``
    holds: a name's second comes first (``events.out.tfevents.<second>.<host>.<pid>...``), so
    two files of one second sort by host and process id, not by when they were opened."""
    names = [path.name.split(".") for path in directory.glob("events.out.tfevents.*")]
    seconds = [int(parts[3]) for parts in names if len(parts) > 3 and parts[3].isdigit()]
    if seconds:
        time.sleep(max(0.0, max(seconds) + 1 - time.time()))


def last_steps(directory: Path) -> dict[str, int]:
    """The last step each tag has in the event files under ``directory`` (none: empty), read by
    TensorBoard's own reader."""
    if not directory.is_dir():
        return {}
    from tensorboard.backend.event_processing import event_accumulator

    reader = event_accumulator.EventAccumulator(
        str(directory), size_guidance={event_accumulator.TENSORS: 0}
    )
    # The reader logs at INFO where each file ended: noise on a resume's terminal.
    library = logging.getLogger("tensorboard")
    level = library.level
    library.setLevel(max(level, logging.WARNING))
    try:
        reader.Reload()
    finally:
        library.setLevel(level)
    return {
        tag: max(event.step for event in reader.Tensors(tag)) for tag in reader.Tags()["tensors"]
    }
