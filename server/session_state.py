"""Writing a session's complete continuation state to a checkpoint, and reading it back.

``read_checkpoint_into`` checks everything (format, config, device type, tensor names, shapes,
dtypes) before it touches the session, so a refused restore changes nothing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire.client.config import setting_differences
from trainwire.client.files import atomic_directory
from trainwire.server import checkpoint as ckpt
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.rng import RngState, preserved_global_rng
from trainwire.server.weights import copy_into, describe_mismatches

if TYPE_CHECKING:
    from trainwire.server.session import TrainingSession


def write_checkpoint(session: TrainingSession, path: Path, extra: dict[str, Any]) -> None:
    files = {
        ckpt.MODEL_FILE: dict(session.model.named_parameters()),
        ckpt.OPTIMIZER_FILE: ckpt.optimizer_state_tensors(session.optimizer),
        ckpt.GRADIENTS_FILE: session.pending_gradients(),
        ckpt.RNG_FILE: session._rng.tensors(),
        ckpt.TRAINER_FILE: session.trainer.session_state_dict(),
    }
    # Serializing, syncing and hashing all release the GIL, so two helper threads write and sync
    # the files while a third computes the state digest from the same tensors (the caller holds
    # the session's lock: nothing changes the state meanwhile). Two writers, not five, bound the
    # host memory a CUDA session's files take while in flight.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="trainwire-checkpoint") as pool:
        digest = pool.submit(session._state_digest_held)
        with atomic_directory(path) as tmp:
            writes = [
                pool.submit(ckpt.save_tensors, tmp / name, tensors, sync=True)
                for name, tensors in files.items()
            ]
            wait(writes)  # all of them, before a failure removes the directory they write into
            for write in writes:
                write.result()
            ckpt.write_json(tmp / ckpt.SESSION_FILE, _metadata(session, digest.result(), extra))


def _metadata(session: TrainingSession, digest: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
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
        "state_digest": digest,
        "extra": extra,
    }


def check_compatible(session: TrainingSession, meta: dict[str, Any]) -> None:
    problems = []
    if meta.get("config_fingerprint") != session.config.fingerprint():
        problems.append(
            f"config fingerprint: saved {meta.get('config_fingerprint')}, now "
            f"{session.config.fingerprint()}"
        )
        problems.extend(setting_differences(meta.get("config", {}), session.config.to_dict()))
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
    gradients = ckpt.load_tensors(path / ckpt.GRADIENTS_FILE)
    problems = describe_mismatches({n: live[n] for n in gradients if n in live}, gradients)
    unknown = sorted(set(gradients) - set(live))
    if problems or unknown:
        raise InvalidArgument(
            f"checkpoint {path.name}: gradients do not fit this model: {problems or unknown[:5]}"
        )
    optimizer_state = ckpt.optimizer_state_from_tensors(
        session.optimizer, ckpt.load_tensors(path / ckpt.OPTIMIZER_FILE)
    )
    try:
        rng_tensors = {n: t.clone() for n, t in ckpt.load_tensors(path / ckpt.RNG_FILE).items()}
        rng = RngState.from_parts(meta["rng"], rng_tensors)
        with preserved_global_rng():
            rng.install()  # a state the generators refuse is refused here, not at the next op
        step, accumulated = int(meta["step"]), int(meta["accumulated"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise InvalidArgument(
            f"checkpoint {path.name}: malformed {ckpt.SESSION_FILE} or RNG state ({error!r})"
        ) from None
    trainer_state = ckpt.load_tensors(path / ckpt.TRAINER_FILE)
    # Owned copies on the session's device, made before anything is applied (a CUDA session
    # may run out of memory here, and must not be left half restored).
    owned_gradients = {n: g.to(live[n].device, copy=True) for n, g in gradients.items()}

    # Everything is read and checked; now apply it (the trainer first: it may still refuse).
    session.trainer.load_session_state_dict(trainer_state)
    apply_restored_tensors(session, live, model_tensors, optimizer_state)
    for name, parameter in live.items():
        parameter.grad = owned_gradients.get(name)
    session.step = step
    session.accumulated = accumulated
    session.base_fingerprint = meta.get("base_model_fingerprint")
    session._rng = rng
    return dict(meta.get("extra") or {})


def apply_restored_tensors(
    session: TrainingSession,
    live: dict[str, Any],
    model_tensors: dict[str, Any],
    optimizer_state: Any,
) -> None:
    """Copy the weights and optimizer state in; a failure midway (out of memory, say) marks the
    session unusable, so it is never used half restored (a retried load_state still works)."""
    try:
        copy_into([(live[name], model_tensors[name]) for name in live])
        ckpt.load_optimizer_state(session.optimizer, optimizer_state)
    except BaseException as error:
        session._break("load_state", error)
        raise


def read_extra(path: Path) -> dict[str, Any]:
    """A checkpoint's ``extra`` state without loading its tensors."""
    return dict(ckpt.read_session_json(path).get("extra") or {})
