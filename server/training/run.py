"""``trainwire train``: run a manifest on this machine through a Lightning Trainer.

Lifecycle: validate (plan, overrides, device, precision, the guards) → set up (session,
module, trainer; the session is restored from the checkpoint when resuming) → fit → summarize.
Nothing is loaded or written until every check has passed, so a refused start or resume leaves
the output directory byte-identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from trainwire.contract.config import TrainingConfig
from trainwire.contract.planning.manifest import load_plan
from trainwire.contract.planning.overrides import checked_config_overrides, config_with_overrides
from trainwire.contract.planning.plan import ManagedTrainingPlan
from trainwire.contract.report.artifacts import write_run_artifacts
from trainwire.contract.report.progress_text import format_value
from trainwire.contract.report.tensorboard_log import (
    TENSORBOARD_DIR,
    TensorBoardLog,
    require_tensorboard,
)
from trainwire.contract.run.replay import RunState, training_result
from trainwire.contract.run.results import TrainingResult
from trainwire.contract.run.selection import BEST_CHECKPOINT
from trainwire.server.engine.session import TrainingSession
from trainwire.server.library_warnings import lightning_fit_quieted, quiet_library_warnings
from trainwire.server.training.callbacks import StopOnInterrupt
from trainwire.server.training.checkpoints import (
    CHECKPOINT_DIR,
    CKPT_SUFFIX,
    LAST_NAME,
    SessionCheckpointIO,
    TrainCheckpointRecord,
    read_checkpoint,
    resolve_checkpoint,
)
from trainwire.server.training.guards import (
    refuse_a_fresh_start_into_a_used_directory,
    refuse_a_resume_from_another_directory,
    refuse_a_resume_of_a_stopped_run,
    refuse_a_resume_under_other_settings,
    refuse_other_constructor_settings,
)
from trainwire.server.training.hardware import (
    LIGHTNING_PRECISION,
    HardwareInfo,
    detect_hardware,
    effective_precision,
)
from trainwire.server.training.module import ManifestModule, PlanProgressBar
from trainwire.server.training.settings import constructor_settings, run_settings
from trainwire.server.training.tensorboard_callback import TensorBoardHistory
from trainwire.server.training.trainer import create_trainer

logger = logging.getLogger(__name__)

EXPORT_DIR = "export"
DEVICES = ("cpu", "cuda")


def train(
    manifest: str | Path,
    output_dir: str | Path,
    *,
    device: str | None = None,
    ckpt_path: str | Path | None = None,
    model_root: str | Path | None = None,
    overrides: Sequence[str] = (),
    callbacks: Sequence[Callback] = (),
    enable_progress_bar: bool = False,
    tensorboard: bool = False,
) -> TrainingResult:
    """Run (or resume, with ``ckpt_path``) a manifest into ``output_dir``; returns the result.

    A run that finishes (plan spent or stopped early) exports its final weights to
    ``output_dir/export`` and writes its artifacts (``training_summary.json``/``.yaml`` with
    the final ``state_digest``, ``metrics.jsonl``, ``loss_curve.png``); a run stopped before
    (a callback asked the trainer to stop) resumes from ``last.ckpt``. Resuming a run whose
    plan is spent trains nothing and writes nothing but the event files ``tensorboard`` asks
    for and the directory does not hold yet. The config's ``model`` resolves under
    ``model_root`` when given (as on a server), else as a path from the working directory.
    With ``tensorboard``, the history also goes to TensorBoard event files in
    ``output_dir/tensorboard`` as the run trains (needs the ``tensorboard`` extra).
    """
    if tensorboard:
        require_tensorboard()
    manifest_path = os.path.realpath(manifest)
    plan = load_run_plan(manifest, overrides)
    # Real paths throughout: a run reached through a symlink keeps its checkpoints' identity.
    output = Path(os.path.realpath(output_dir))
    hardware = run_hardware(plan.config, device)
    resume = check_start(plan, output, hardware, ckpt_path)
    if tensorboard and resume is None:
        # Its files would hold another run's steps, which this run's would then skip.
        refuse_a_fresh_start_into_a_used_directory(output / TENSORBOARD_DIR)
    if resume is not None and resume.cursor >= plan.batch_count:
        logger.info("%s: the plan is spent; nothing to train", resume.path)
        state = RunState.from_dict(resume.record["run_state"])
        if tensorboard:  # given only now, it writes the whole history
            with TensorBoardLog(output / TENSORBOARD_DIR) as board:
                board.follow(state.history)
        return training_result(
            plan,
            state,
            state_digest=resume.state_digest or "",
            last_checkpoint_path=str(resume.path),
            config_path=manifest_path,
        )

    output.mkdir(parents=True, exist_ok=True)
    quiet_library_warnings()
    session = TrainingSession(
        plan.config, device=hardware.accelerator, max_steps=plan.max_steps, model_root=model_root
    )
    module = ManifestModule(plan, session, run_record=run_record(plan, output, hardware))
    # The event files are written first at each microbatch's end, before a caller's callback
    # may stop the run there.
    run_callbacks = [TensorBoardHistory(output / TENSORBOARD_DIR)] if tensorboard else []
    run_callbacks += [*callbacks, PlanProgressBar()] if enable_progress_bar else list(callbacks)
    trainer, checkpoint, _ = create_trainer(
        plan.config,
        hardware,
        output / CHECKPOINT_DIR,
        run_callbacks,
        plugins=[SessionCheckpointIO(session)],
        enable_progress_bar=enable_progress_bar,
    )
    # With a checkpoint, Lightning restores its loops and callbacks, and the module its session.
    with lightning_fit_quieted():
        trainer.fit(module, ckpt_path=None if resume is None else resume.path)
    return finish(module, checkpoint, hardware, output, config_path=manifest_path)


def load_run_plan(manifest: str | Path, overrides: Sequence[str]) -> ManagedTrainingPlan:
    """The manifest's plan (fingerprint verified), re-planned when ``--set`` changes its config."""
    plan = load_plan(manifest)
    if not checked_config_overrides(overrides):
        return plan
    config = config_with_overrides(plan.config.to_dict(), overrides)
    return ManagedTrainingPlan(plan.examples, config, eval_examples=plan.eval_examples)


def run_hardware(config: TrainingConfig, device: str | None) -> HardwareInfo:
    """Where the run trains: ``device``, or CUDA where there is one, else the CPU (the engine
    runs on cpu or cuda), at the precision the config allows there."""
    detected = detect_hardware(
        log_info=True, cuda_precision=LIGHTNING_PRECISION.get(config.precision, "32-true")
    )
    accelerator = device or ("cuda" if detected.accelerator == "cuda" else "cpu")
    if accelerator not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {accelerator!r}")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine; use --device cpu")
    precision = effective_precision(config, accelerator)
    if accelerator == detected.accelerator:
        return dataclasses.replace(detected, precision=precision)
    return HardwareInfo(
        accelerator=accelerator,
        precision=precision,
        num_devices=1,
        device_name=accelerator,
        torch_version=str(torch.__version__),
    )


def check_start(
    plan: ManagedTrainingPlan,
    output: Path,
    hardware: HardwareInfo,
    ckpt_path: str | Path | None,
) -> TrainCheckpointRecord | None:
    """The guards of a fresh start or a resume; returns the checkpoint to resume from."""
    checkpoint_dir = output / CHECKPOINT_DIR
    found = resolve_checkpoint(ckpt_path, output, CHECKPOINT_DIR)
    if ckpt_path is None or str(ckpt_path) == "":
        refuse_a_fresh_start_into_a_used_directory(checkpoint_dir)
        return None
    if found.path is None:
        raise FileNotFoundError(
            f"no {LAST_NAME}{CKPT_SUFFIX} in {checkpoint_dir}: nothing to resume there; start "
            "a fresh run without --ckpt-path, or pass the checkpoint file itself"
        )
    checkpoint = read_checkpoint(found.path)
    info = TrainCheckpointRecord.from_checkpoint(found.path, checkpoint)
    logger.info("resuming from %s at microbatch %d of %d", info.path, info.cursor, info.batch_count)
    config = plan.config
    settings = run_settings(config, accelerator=hardware.accelerator, precision=hardware.precision)
    refuse_a_resume_from_another_directory(checkpoint, checkpoint_dir)
    refuse_other_constructor_settings(checkpoint, config, what=str(info.path))
    refuse_a_resume_under_other_settings(
        checkpoint, settings, seed=config.seed, manifest_fingerprint=plan.fingerprint
    )
    refuse_a_resume_of_a_stopped_run(
        checkpoint, config.early_stopping_patience if config.early_stopping else None
    )
    if info.session_checkpoint is None or not info.session_checkpoint.is_dir():
        raise ValueError(
            f"{info.path}: its session checkpoint {info.session_checkpoint} is missing; "
            "resume from another checkpoint of that run"
        )
    return info


def run_record(plan: ManagedTrainingPlan, output: Path, hardware: HardwareInfo) -> dict[str, Any]:
    """The run's identity, recorded in every checkpoint and checked on every resume."""
    config = plan.config
    return {
        "output_dir": str(output),
        "settings": run_settings(
            config, accelerator=hardware.accelerator, precision=hardware.precision
        ),
        "constructor_settings": constructor_settings(config),
        "seed": config.seed,
    }


def finish(
    module: ManifestModule,
    checkpoint: Any,
    hardware: HardwareInfo,
    output: Path,
    *,
    config_path: str | None = None,
) -> TrainingResult:
    """The result; a finished run also exports its weights and writes its artifacts."""
    last = getattr(checkpoint, "last_model_path", "") or None
    result = module.result(last_checkpoint_path=last, config_path=config_path)
    if not module.finished:
        logger.warning(
            "stopped at microbatch %d of %d; resume with --ckpt-path %s",
            module.run_state.next_microbatch,
            module.plan.batch_count,
            LAST_NAME,
        )
        return result
    export_dir = output / EXPORT_DIR
    export_weights(module.session, result, export_dir)
    write_run_artifacts(
        output,
        result,
        module.plan,
        hardware=hardware.to_dict(),
        runner="lightning",
        export_dir=str(export_dir),
        exported_from=BEST_CHECKPOINT if result.best_checkpoint_path else "live",
    )
    return result


def export_weights(session: TrainingSession, result: TrainingResult, path: Path) -> None:
    """The best weights (from a detached CPU copy of the best checkpoint) or, without
    evaluation, the last: what ManagedTraining exports too."""
    if result.best_checkpoint_path is None:
        session.export_weights(path)
        return
    best = TrainCheckpointRecord.read(result.best_checkpoint_path)
    session.export_checkpoint_weights(best.session_checkpoint, path)


def run_train_command(args: argparse.Namespace) -> int:
    """The ``trainwire train`` handler: train, then print where the results are."""
    # Our own lines say where and how it trains; Lightning's info lines would repeat them.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    interrupt = StopOnInterrupt()
    result = train(
        args.manifest,
        args.output,
        device=args.device,
        ckpt_path=args.ckpt_path,
        model_root=args.model_root,
        overrides=args.set,
        callbacks=[interrupt],
        enable_progress_bar=True,
        tensorboard=args.tensorboard,
    )
    updates = sum(1 for record in result.history if record["kind"] == "update")
    if interrupt.requested:
        print(
            f"{args.output}: interrupted after {updates} updates; resume with "
            f"--ckpt-path {LAST_NAME}"
        )
        return 130
    best = (
        f", best {format_value(result.best_score)} at update {result.best_step}"
        if result.best_score is not None
        else ""
    )
    stopped = ", stopped early" if result.early_stopped else ""
    print(f"{args.output}: {updates} updates{best}{stopped}; state_digest {result.state_digest}")
    return 0
