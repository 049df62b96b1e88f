"""The guards every start and resume passes before anything is loaded or written.

Each takes what the seed's guards take (a checkpoint directory, or the dict ``read_checkpoint``
returns), raises a ``ValueError`` that names every difference with its saved and current values
(``setting_differences``' one wording) and says what to do instead; none changes a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainwire.contract.config import TrainingConfig, setting_differences
from trainwire.server.training.callbacks import OutcomeCheckpoint
from trainwire.server.training.checkpoints import CKPT_SUFFIX, RECORD_KEY, train_record
from trainwire.server.training.settings import constructor_settings

FRESH_RUN = "start a fresh run in a new --output directory"


def refuse_a_fresh_start_into_a_used_directory(checkpoint_dir: str | Path) -> None:
    """Refuse a fresh run into a checkpoint directory that exists and is not empty.

    Its checkpoints would sit beside another run's, and ``--ckpt-path last`` would later
    resolve to that run's ``last.ckpt``. A path that exists but is not a directory is refused
    too. A directory that does not exist yet, or is empty, passes.
    """
    directory = Path(checkpoint_dir)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; {FRESH_RUN}")
    found = sorted(p.name for p in directory.iterdir())
    if not found:
        return
    checkpoints = [name for name in found if name.endswith(CKPT_SUFFIX)]
    shown = _shown(checkpoints or found)
    what = f"a run's checkpoints ({shown})" if checkpoints else f"other files ({shown})"
    raise ValueError(
        f"{directory} already holds {what}; resume it with --ckpt-path last, or {FRESH_RUN}"
    )


def refuse_a_resume_from_another_directory(
    checkpoint: Mapping[str, Any],
    checkpoint_dir: str | Path,
    *,
    resolved_dirpath: str | None = None,
) -> None:
    """Refuse a resume from a checkpoint that this run's ModelCheckpoint saved elsewhere.

    Lightning restores ModelCheckpoint's best-so-far only into the directory it was saved from:
    elsewhere the resumed run would forget the earlier best. The directories compare as
    ModelCheckpoint stores them, as real paths, so a symlink to the run's directory passes.
    ``resolved_dirpath``, when given, is compared literally instead of ``checkpoint_dir``'s
    real path (a caller that resolved it already, on another host say).

    Raises:
        ValueError: the checkpoint holds no state of this run's ModelCheckpoint
            (``OutcomeCheckpoint``), or one saved in another directory.
    """
    states = _callback_states(checkpoint, OutcomeCheckpoint.__qualname__)
    if not states:
        raise ValueError(
            "the checkpoint holds no state of this run's ModelCheckpoint (OutcomeCheckpoint), "
            f"so it cannot be resumed here; {FRESH_RUN}"
        )
    now = resolved_dirpath if resolved_dirpath is not None else os.path.realpath(checkpoint_dir)
    for state in states.values():
        saved = state.get("dirpath")
        if saved != now:
            raise ValueError(
                f"the checkpoint belongs to the run in {saved}, not to {now}; resume it from "
                f"there (trainwire train: --output {Path(str(saved)).parent}), or start a "
                "fresh run without --ckpt-path"
            )


def refuse_a_resume_under_other_settings(
    checkpoint: Mapping[str, Any],
    settings: Mapping[str, Any],
    *,
    seed: int,
    manifest_fingerprint: str | None = None,
) -> None:
    """Refuse an exact resume under other run settings or another seed.

    ``settings`` is this run's ``run_settings(cfg, accelerator=..., precision=...)``: the
    checkpoint records exactly those, so an unchanged run passes. A changed setting (the
    accumulation, a learning rate, the epoch budget, the precision) would change the run
    mid-way, and the seed drew the plan's order and the dropout masks. ``manifest_fingerprint``
    (an extra option), when given, is compared with the plan fingerprint recorded beside the
    settings, in the same message, so a resume under another plan names that too.

    Raises:
        ValueError: the checkpoint records no run settings, or a setting, the seed or the
            plan differs, naming each difference with its saved and current values.
    """
    record = train_record(checkpoint)
    saved = record.get("settings")
    if not isinstance(saved, dict):
        raise ValueError(f"the checkpoint records no run settings; {FRESH_RUN}")
    differences = setting_differences(saved, settings)
    differences += setting_differences({"seed": record.get("seed")}, {"seed": seed})
    if manifest_fingerprint is not None:
        differences += setting_differences(
            {"manifest_fingerprint": record.get("plan_fingerprint")},
            {"manifest_fingerprint": manifest_fingerprint},
        )
    if differences:
        raise ValueError(
            f"cannot resume under other settings: {'; '.join(differences)}. Resume with the "
            "settings it was saved with (the same manifest, --device and --set), or "
            f"{FRESH_RUN}"
        )


def refuse_a_resume_of_a_stopped_run(checkpoint: Mapping[str, Any], patience: int | None) -> None:
    """Refuse an exact resume of a run that early stopping ended.

    Lightning restores EarlyStopping's state but not the trainer's stop, so a resumed run
    would train past its own decision and could keep another best after the fact. The state
    read is the one this run's EarlyStopping (``outcome_early_stopping(patience)``) restores;
    the replay's own decision, recorded beside it, is read too. A run that spent its plan
    without an early stop is not refused: its resume trains nothing. ``patience`` None (a run
    without early stopping) expects no EarlyStopping state.

    Raises:
        ValueError: the checkpoint holds no state of this run's EarlyStopping, or records a
            stop, naming where it stopped.
    """
    states = _callback_states(checkpoint, "EarlyStopping")
    if patience is not None:
        mine = {key: s for key, s in states.items() if s.get("patience") == patience}
        if not mine:
            found = sorted(s.get("patience") for s in states.values())
            raise ValueError(
                f"the checkpoint holds no state of this run's EarlyStopping (patience {patience})"
                + (f"; it holds one with patience {found[0]}" if found else "")
                + f"; resume with the settings it was saved with, or {FRESH_RUN}"
            )
        states = mine
    stopped_epochs = [int(s.get("stopped_epoch", 0)) for s in states.values()]
    record = checkpoint.get(RECORD_KEY) or {}
    selection = (record.get("run_state") or {}).get("selection") or {}
    if not selection.get("stopped_early") and not any(e > 0 for e in stopped_epochs):
        return
    best = ""
    if selection:
        best = (
            f" after {selection.get('evaluations_without_gain')} evaluation(s) without gain "
            f"(best {selection.get('metric')} {selection.get('best_value')} at update "
            f"{selection.get('best_step')})"
        )
    epoch = f", EarlyStopping's stopped_epoch {max(stopped_epochs)}" if stopped_epochs else ""
    raise ValueError(
        f"early stopping ended that run at update {checkpoint.get('global_step')}{best}"
        f"{epoch}; there is nothing to resume. Use its best checkpoint, or start a new run "
        "(with more early_stopping_patience, say) in a new --output directory"
    )


def refuse_other_constructor_settings(
    checkpoint: Mapping[str, Any], cfg: TrainingConfig, *, what: str = "the checkpoint"
) -> None:
    """Refuse weights trained in another model: base model, task, labels, LoRA adapter.

    Lightning restores tensors, not the controls that built the model (LoRA rank, alpha,
    dropout, targets, DoRA), so they are compared with ``constructor_settings(cfg)`` before a
    resume; a checkpoint that records none is refused.

    Raises:
        ValueError: the checkpoint records no constructor settings, or other ones, naming each
            difference with its saved and current values.
    """
    saved = train_record(checkpoint).get("constructor_settings")
    if not isinstance(saved, dict):
        raise ValueError(f"{what} records no model settings; {FRESH_RUN}")
    differences = setting_differences(saved, constructor_settings(cfg))
    if differences:
        raise ValueError(
            f"{what} was trained in another model: {'; '.join(differences)}. Use the model "
            f"settings it was trained with, or {FRESH_RUN}"
        )


def _callback_states(checkpoint: Mapping[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """The saved states of the checkpoint's callbacks of class ``kind``, by Lightning's state
    key (the class name, then the arguments that identify the instance)."""
    callbacks = checkpoint.get("callbacks") or {}
    return {
        key: state
        for key, state in callbacks.items()
        if isinstance(key, str) and key.startswith(kind + "{") and isinstance(state, dict)
    }


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
