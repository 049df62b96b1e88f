"""The guards every start and resume passes before anything is loaded or written.

Each raises a ``ValueError`` that says what happened and what to do instead; none changes a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwire.client.config import setting_differences
from trainwire.server.training.checkpoints import CKPT_SUFFIX, CheckpointInfo


def refuse_a_fresh_start_into_a_used_directory(checkpoint_dir: str | Path) -> None:
    """A fresh start must not mix its checkpoints with another run's."""
    directory = Path(checkpoint_dir)
    found = sorted(p.name for p in directory.glob(f"*{CKPT_SUFFIX}")) if directory.is_dir() else []
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(
            f"{directory} already holds a run's checkpoints ({shown}); resume it with "
            "--ckpt-path last, or start fresh in a new --output directory"
        )


def refuse_a_resume_from_another_directory(info: CheckpointInfo, output_dir: str | Path) -> None:
    """A run resumes where it was written; real paths compare, so a symlink to it passes."""
    now = os.path.realpath(output_dir)
    saved = info.output_dir
    if saved is None:
        raise ValueError(
            f"{info.path} records no run directory, so it cannot be resumed into {now}; "
            "start a fresh run in an empty --output directory instead"
        )
    if os.path.realpath(saved) != now:
        raise ValueError(
            f"{info.path} belongs to the run in {saved}, not to {now}; resume it with "
            f"--output {saved}, or start a fresh run in {now} without --ckpt-path"
        )


def refuse_a_resume_under_other_settings(
    info: CheckpointInfo, settings: Mapping[str, Any], *, seed: int | None
) -> None:
    """A resume continues the exact run: every free setting and the seed as saved."""
    differences = setting_differences(info.settings, settings)
    differences += setting_differences(_seed(info.seed), _seed(seed))
    if differences:
        raise ValueError(
            f"cannot resume {info.path} under other settings: {'; '.join(differences)}. "
            "Resume with the settings it was saved with (the same manifest, --device and "
            "--set), or start a new run in a new --output directory"
        )


def refuse_a_resume_of_a_stopped_run(info: CheckpointInfo) -> None:
    """Early stopping ended that run on purpose; resuming it would train past its decision."""
    if info.early_stopped:
        selection = info.record["run_state"]["selection"]
        raise ValueError(
            f"{info.path}: early stopping ended that run at update {info.global_step} after "
            f"{selection.get('evaluations_without_gain')} evaluation(s) without gain (best "
            f"{selection.get('metric')} {selection.get('best_value')} at update "
            f"{selection.get('best_step')}); there is nothing to resume. Use its best "
            "checkpoint, or start a new run (with more early_stopping_patience, say) in a new "
            "--output directory"
        )


def refuse_other_constructor_settings(
    saved: Mapping[str, Any], now: Mapping[str, Any], *, what: str = "the checkpoint"
) -> None:
    """Weights only fit the model they were trained in: same base, task, labels and adapter."""
    differences = setting_differences(saved, now)
    if differences:
        raise ValueError(
            f"{what} was trained in another model: {'; '.join(differences)}. Use the model "
            "settings it was trained with, or start a new run in a new --output directory"
        )


def _seed(seed: int | None) -> dict[str, Any]:
    return {} if seed is None else {"seed": seed}
