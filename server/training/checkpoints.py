"""Lightning checkpoints of a local run, and the session checkpoints that ride beside them.

Lightning loads a ``.ckpt`` with ``weights_only=True``, so it may hold tensors and primitives
only. The engine's complete continuation state (weights, optimizer moments, pending gradients,
RNG) is a session checkpoint directory written by ``TrainingSession.save_state`` beside the
``.ckpt``; the ``.ckpt`` records its relative path and the plan cursor under ``RECORD_KEY``,
in JSON-safe primitives only.

Layout of a run's checkpoint directory:

    last.ckpt                          the latest state (every Lightning epoch end)
    last.session-<cursor>/             its session checkpoint
    best-epoch=E-step=S.ckpt           the earliest evaluation with the best metric
    best-epoch=E-step=S.session-<c>/   its session checkpoint
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from trainwire.contract.files import write_bytes_atomic

if TYPE_CHECKING:
    from trainwire.server.engine.session import TrainingSession

CHECKPOINT_DIR = "checkpoints"
LAST_NAME = "last"
CKPT_SUFFIX = ".ckpt"
LAST_CHECKPOINT = LAST_NAME + CKPT_SUFFIX
SESSION_INFIX = ".session-"
RECORD_KEY = "trainwire"
RECORD_FORMAT = "trainwire.lightning/v1"


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a run resumes from, as ``resolve_checkpoint`` found it (the seed's record).

    Attributes:
        path: the checkpoint file (absolute), or None: a fresh start, or ``last`` not found.
        is_same_stage: the checkpoint lies in this experiment's own directory
            (``checkpoint_dir/experiment_name``), as ``last`` always does.
        exists: the checkpoint file exists.
    """

    path: str | None
    is_same_stage: bool
    exists: bool


def resolve_checkpoint(
    ckpt_path: str | Path | None, checkpoint_dir: str | Path, experiment_name: str
) -> CheckpointInfo:
    """Resolve the checkpoint a run resumes from.

    Three cases, as in the seed:

    1. None (or ""): no checkpoint, a fresh start: ``CheckpointInfo(None, False, False)``.
    2. ``last`` or ``last.ckpt``: ``checkpoint_dir/experiment_name/last.ckpt``; when it is
       missing, ``path`` is None and ``exists`` False, for the caller to decide.
    3. Any other path: validated: a missing file raises ``FileNotFoundError`` (stricter than
       the seed: a mistyped path never silently becomes a fresh start).

    Example:
        >>> info = resolve_checkpoint("last", Path("checkpoints"), "reference")
        >>> if info.exists:
        ...     print(f"Resuming from {info.path}")
    """
    if ckpt_path is None or str(ckpt_path) == "":
        return CheckpointInfo(path=None, is_same_stage=False, exists=False)
    stage = Path(checkpoint_dir) / experiment_name
    if str(ckpt_path) in (LAST_NAME, LAST_CHECKPOINT):
        last = stage / LAST_CHECKPOINT
        if not last.is_file():
            return CheckpointInfo(path=None, is_same_stage=False, exists=False)
        return CheckpointInfo(path=str(last.absolute()), is_same_stage=True, exists=True)
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"checkpoint {path} {what}")
    same = os.path.realpath(path.parent) == os.path.realpath(stage)
    return CheckpointInfo(path=str(path.absolute()), is_same_stage=same, exists=True)


def train_record(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The ``trainwire train`` record a Lightning checkpoint's dict carries (``RECORD_KEY``).

    Raises ``ValueError`` for a checkpoint that another program wrote.
    """
    record = checkpoint.get(RECORD_KEY)
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise ValueError(
            f"the checkpoint is not one that `trainwire train` wrote (no {RECORD_FORMAT} "
            "record); resume from last.ckpt of a trainwire train output directory"
        )
    return record


@dataclass(frozen=True)
class TrainCheckpointRecord:
    """What a ``trainwire train`` checkpoint says about its run (richer than ``CheckpointInfo``,
    which only says where a checkpoint is).

    Attributes:
        path: the ``.ckpt`` file.
        epoch, global_step: Lightning's loop counters (global_step counts optimizer updates).
        cursor: the next microbatch to run; ``batch_count`` when the plan is spent.
        batch_count: microbatches in the run's plan.
        early_stopped: early stopping ended the run.
        output_dir: the real path of the directory the run wrote to.
        seed: the config's seed.
        settings: the run's free settings (``run_settings``).
        constructor_settings: what shaped the model (``constructor_settings``).
        plan_fingerprint: the fingerprint of the manifest's plan it trains.
        session_checkpoint: the session checkpoint directory beside the ``.ckpt``.
        state_digest: the session's ``state_digest()`` when the checkpoint was written.
        record: the whole record; ``record["run_state"]`` is the replay's ``RunState``.
    """

    path: Path
    epoch: int
    global_step: int
    cursor: int
    batch_count: int
    early_stopped: bool
    output_dir: str | None
    seed: int | None
    settings: dict[str, Any]
    constructor_settings: dict[str, Any]
    plan_fingerprint: str | None
    session_checkpoint: Path | None
    state_digest: str | None
    record: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, checkpoint: Mapping[str, Any]
    ) -> TrainCheckpointRecord:
        path = Path(path)
        try:
            record = train_record(checkpoint)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        session = record.get("session_checkpoint")
        run_state = record["run_state"]
        return cls(
            path=path,
            epoch=int(checkpoint.get("epoch", 0)),
            global_step=int(checkpoint.get("global_step", 0)),
            cursor=int(run_state["next_microbatch"]),
            batch_count=int(record["batch_count"]),
            early_stopped=bool(run_state["selection"]["stopped_early"]),
            output_dir=record.get("output_dir"),
            seed=record.get("seed"),
            settings=dict(record.get("settings") or {}),
            constructor_settings=dict(record.get("constructor_settings") or {}),
            plan_fingerprint=record.get("plan_fingerprint"),
            session_checkpoint=None if session is None else path.parent / session,
            state_digest=record.get("state_digest"),
            record=record,
        )

    @classmethod
    def read(cls, path: str | Path) -> TrainCheckpointRecord:
        """Read a checkpoint (weights only, on the CPU) and describe it."""
        return cls.from_checkpoint(path, read_checkpoint(path))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("record")
        out["path"] = str(self.path)
        out["session_checkpoint"] = (
            None if self.session_checkpoint is None else str(self.session_checkpoint)
        )
        return out


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint's contents, on the CPU: the dict the guards take.

    Safer than the seed, which loads with ``weights_only=False`` and so trusts the file: this
    loads with ``weights_only=True``. A ``trainwire train`` checkpoint holds tensors and
    primitives only (the run's record is JSON-safe), so it loads whole; anything else (a pickled
    object, a planted payload) is refused with ``ValueError`` and never unpickled.
    """
    try:
        checkpoint = torch.load(Path(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"{path}: refused: not a weights-only checkpoint ({reason}). trainwire loads "
            "checkpoints with weights_only=True and never runs pickled code"
        ) from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path}: not a Lightning checkpoint (a {type(checkpoint).__name__})")
    return checkpoint


def session_checkpoint_name(ckpt_path: Path, cursor: int) -> str:
    """The session checkpoint beside ``ckpt_path``; the cursor makes each save a new directory,
    so the ``.ckpt`` being replaced keeps pointing at a complete one."""
    return f"{ckpt_path.stem}{SESSION_INFIX}{cursor}"


def session_checkpoints_of(ckpt_path: Path) -> list[Path]:
    prefix = ckpt_path.stem + SESSION_INFIX
    if not ckpt_path.parent.is_dir():
        return []
    return sorted(p for p in ckpt_path.parent.iterdir() if p.is_dir() and p.name.startswith(prefix))


class SessionCheckpointIO(TorchCheckpointIO):
    """Writes each Lightning checkpoint together with the session checkpoint beside it.

    Order of a save: the session checkpoint (atomic directory), then the ``.ckpt`` (atomic file)
    that names it, then the superseded session checkpoints of that ``.ckpt``. A crash anywhere
    leaves a ``.ckpt`` whose session checkpoint is complete. Loading is always weights-only.
    """

    def __init__(self, session: TrainingSession) -> None:
        super().__init__()
        self.session = session

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        record = checkpoint.get(RECORD_KEY)
        keep = None
        if record is not None:
            keep = session_checkpoint_name(path, record["run_state"]["next_microbatch"])
            record["session_checkpoint"] = keep
            self.session.save_state(path.parent / keep, extra=record)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        write_bytes_atomic(path, buffer.getvalue())
        for stale in session_checkpoints_of(path):
            if stale.name != keep:
                shutil.rmtree(stale, ignore_errors=True)

    def load_checkpoint(
        self, path: str | Path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Always weights-only on the CPU, whatever the caller asks: a checkpoint never runs code.
        return read_checkpoint(path)

    def remove_checkpoint(self, path: str | Path) -> None:
        super().remove_checkpoint(path)
        for session in session_checkpoints_of(Path(path)):
            shutil.rmtree(session, ignore_errors=True)
