"""Reading a session checkpoint back into a live session: all of it read and checked first.

``read_checkpoint`` reads the whole checkpoint and checks it against the live session (format,
config, device type, tensor names, shapes and dtypes, an RNG state the generators accept) before
it returns, so a refused restore changes nothing. It also makes the owned copies a restore keeps
(optimizer state, gradients) on the session's device, so running out of memory there changes
nothing either. The engine (``TrainingSession``) then applies the ``RestoredState``; only
that copy into live tensors can fail midway, and a failure there marks the session broken. The
files themselves are ``session.checkpoint``'s format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainwire.contract.config import TrainingConfig, setting_differences
from trainwire.server.engine.session.checkpoint import (
    EXTRA_KEY,
    GRADIENTS_FILE,
    LOSS_HOOK_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SESSION_FILE,
    OptimizerState,
    Tensors,
    load_optimizer_state,
    optimizer_state_from_tensors,
    read_session_json,
)
from trainwire.server.engine.session.rng import RngState, preserved_global_rng
from trainwire.server.engine.weights.tensor_files import (
    copy_into,
    describe_mismatches,
    load_tensors,
)
from trainwire.server.errors import FailedPrecondition, InvalidArgument


@dataclass(frozen=True)
class RestoredState:
    """A checkpoint's state, read and checked against the live session, not yet applied."""

    step: int
    accumulated: int
    base_model_fingerprint: str | None
    rng: RngState
    parameters: Tensors  # the checkpoint's, names and shapes equal to the live ones
    optimizer_state: OptimizerState
    gradients: Tensors  # owned copies, on the live parameters' devices
    loss_hook_state: Tensors
    extra: dict[str, Any] = field(default_factory=dict)

    def apply_tensors(self, live: Tensors, optimizer: torch.optim.Optimizer) -> None:
        """Copy the weights and optimizer state in (the caller marks a failure midway)."""
        copy_into([(live[name], self.parameters[name]) for name in live])
        load_optimizer_state(optimizer, self.optimizer_state)


def check_compatible(
    meta: dict[str, Any], config: TrainingConfig, device_type: str, max_steps: int | None
) -> None:
    """FailedPrecondition naming every way the checkpoint's session differs from this one."""
    problems = []
    if meta.get("config_fingerprint") != config.fingerprint():
        problems.append(
            f"config fingerprint: saved {meta.get('config_fingerprint')}, now "
            f"{config.fingerprint()}"
        )
        problems.extend(setting_differences(meta.get("config", {}), config.to_dict()))
    if meta.get("device_type") != device_type:
        problems.append(f"device type: saved {meta.get('device_type')}, now {device_type}")
    if meta.get("max_steps") != max_steps:
        problems.append(f"max_steps: saved {meta.get('max_steps')}, now {max_steps}")
    if problems:
        raise FailedPrecondition(
            "the checkpoint belongs to another session: " + "; ".join(problems)
        )


def read_checkpoint(
    path: Path,
    *,
    config: TrainingConfig,
    device_type: str,
    max_steps: int | None,
    live: Tensors,
    optimizer: torch.optim.Optimizer,
) -> RestoredState:
    """Read and check everything in checkpoint ``path`` against the live session's."""
    meta = read_session_json(path)
    check_compatible(meta, config, device_type, max_steps)
    model_tensors = load_tensors(path / MODEL_FILE)
    problems = describe_mismatches(live, model_tensors)
    if problems:
        raise InvalidArgument(f"checkpoint {path.name} does not fit this model: {problems}")
    gradients = load_tensors(path / GRADIENTS_FILE)
    problems = describe_mismatches({n: live[n] for n in gradients if n in live}, gradients)
    unknown = sorted(set(gradients) - set(live))
    if problems or unknown:
        raise InvalidArgument(
            f"checkpoint {path.name}: gradients do not fit this model: {problems or unknown[:5]}"
        )
    optimizer_state = optimizer_state_from_tensors(optimizer, load_tensors(path / OPTIMIZER_FILE))
    try:
        rng_tensors = {n: t.clone() for n, t in load_tensors(path / RNG_FILE).items()}
        rng = RngState.from_parts(meta["rng"], rng_tensors)
        with preserved_global_rng():
            rng.install()  # a state the generators refuse is refused here, not at the next op
        step, accumulated = int(meta["step"]), int(meta["accumulated"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise InvalidArgument(
            f"checkpoint {path.name}: malformed {SESSION_FILE} or RNG state ({error!r})"
        ) from None
    loss_hook_state = load_tensors(path / LOSS_HOOK_FILE)
    # Owned copies on the session's device, made before anything is applied (a CUDA session
    # may run out of memory here, and must not be left half restored).
    owned_gradients = {n: g.to(live[n].device, copy=True) for n, g in gradients.items()}
    return RestoredState(
        step=step,
        accumulated=accumulated,
        base_model_fingerprint=meta.get("base_model_fingerprint"),
        rng=rng,
        parameters=model_tensors,
        optimizer_state=optimizer_state,
        gradients=owned_gradients,
        loss_hook_state=loss_hook_state,
        extra=dict(meta.get(EXTRA_KEY) or {}),
    )
