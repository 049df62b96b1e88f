"""Writing a session's complete continuation state to a checkpoint, and reading it back.

``read_checkpoint_into`` checks everything (format, config, device type, tensor names, shapes,
dtypes) before it touches the session, so a refused restore changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire.server import checkpoint as ckpt
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.rng import RngState
from trainwire.server.weights import copy_into, describe_mismatches

if TYPE_CHECKING:
    from trainwire.server.session import TrainingSession


def write_checkpoint(session: TrainingSession, path: Path, extra: dict[str, Any]) -> None:
    meta = {
        "format": ckpt.CHECKPOINT_FORMAT,
        "config": session.config.to_dict(),
        "config_fingerprint": session.config.fingerprint(),
        "device_type": session.device.type,
        "step": session.step,
        "accumulated": session.accumulated,
        "max_steps": session.max_steps,
        "base_model_fingerprint": session.base_fingerprint,
        "trainer": type(session.trainer).__name__,
        "rng": session._rng.to_json(),
        "state_digest": session.state_digest(),
        "extra": extra,
    }
    with ckpt.atomic_directory(path) as tmp:
        ckpt.save_tensors(tmp / ckpt.MODEL_FILE, dict(session.model.named_parameters()))
        ckpt.save_tensors(
            tmp / ckpt.OPTIMIZER_FILE, ckpt.optimizer_state_tensors(session.optimizer)
        )
        ckpt.save_tensors(tmp / ckpt.GRADIENTS_FILE, session.pending_gradients())
        ckpt.save_tensors(tmp / ckpt.RNG_FILE, session._rng.tensors())
        ckpt.save_tensors(tmp / ckpt.TRAINER_FILE, session.trainer.session_state_dict())
        ckpt.write_json(tmp / ckpt.SESSION_FILE, meta)


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each differing config key, saved vs now (``absent`` where one side lacks it)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "absent"), now.get(key, "absent")
        if a != b:
            out.append(f"{key}: saved {a!r}, now {b!r}")
    return out


def check_compatible(session: TrainingSession, meta: dict[str, Any]) -> None:
    problems = []
    if meta.get("config_fingerprint") != session.config.fingerprint():
        problems.append(
            f"config fingerprint: saved {meta.get('config_fingerprint')}, now "
            f"{session.config.fingerprint()}"
        )
        problems.extend(config_differences(meta.get("config", {}), session.config.to_dict()))
    if meta.get("device_type") != session.device.type:
        problems.append(f"device type: saved {meta.get('device_type')}, now {session.device.type}")
    if meta.get("max_steps") != session.max_steps:
        problems.append(f"max_steps: saved {meta.get('max_steps')}, now {session.max_steps}")
    if problems:
        raise FailedPrecondition(
            "the checkpoint belongs to another session: " + "; ".join(problems)
        )


def read_checkpoint_into(session: TrainingSession, path: Path) -> dict[str, Any]:
    meta = ckpt.read_session_json(path)
    check_compatible(session, meta)
    live = dict(session.model.named_parameters())
    model_tensors = ckpt.load_tensors(path / ckpt.MODEL_FILE)
    problems = describe_mismatches(live, model_tensors)
    if problems:
        raise InvalidArgument(f"checkpoint {path.name} does not fit this model: {problems}")
    optimizer_tensors = ckpt.load_tensors(path / ckpt.OPTIMIZER_FILE)
    gradients = ckpt.load_tensors(path / ckpt.GRADIENTS_FILE)
    unknown = sorted(set(gradients) - set(live))
    if unknown:
        raise InvalidArgument(f"checkpoint {path.name}: gradients for unknown {unknown[:5]}")
    rng = RngState.from_parts(meta["rng"], ckpt.load_tensors(path / ckpt.RNG_FILE))
    trainer_state = ckpt.load_tensors(path / ckpt.TRAINER_FILE)

    # Everything is read and checked; now apply it (the trainer first: it may still refuse).
    session.trainer.load_session_state_dict(trainer_state)
    copy_into([(live[name], model_tensors[name]) for name in live])
    ckpt.load_optimizer_state(session.optimizer, optimizer_tensors)
    for name, parameter in live.items():
        grad = gradients.get(name)
        parameter.grad = None if grad is None else grad.to(parameter.device).clone()
    session.step = int(meta["step"])
    session.accumulated = int(meta["accumulated"])
    session.base_fingerprint = meta.get("base_model_fingerprint")
    session._rng = rng
    return dict(meta.get("extra") or {})


def read_extra(path: Path) -> dict[str, Any]:
    """A checkpoint's ``extra`` state without loading its tensors."""
    return dict(ckpt.read_session_json(path).get("extra") or {})
