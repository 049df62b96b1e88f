"""The session checkpoint format: what a checkpoint holds, how it is written and read back.

One directory, written atomically (``client.files.atomic_directory``), holding no pickle::

    session.json            format, config and fingerprint, step, accumulation counter, device
                            type, base-model fingerprint, loss hook, RNG (Python, NumPy), state
                            digest, extra state
    model.safetensors       every parameter, by its live name
    optimizer.safetensors   AdamW moments and step counts, as ``<param index>.<name>``
    gradients.safetensors   pending (accumulated, not yet applied) gradients
    rng.safetensors         torch CPU and CUDA generator states
    trainer.safetensors     the loss hook's own state (a custom hook's buffers)

This module is the format: its files and metadata, the optimizer state as flat tensors, the state
digest (and ``verify_checkpoint``, which checks a checkpoint against it without a session), and
writing. Reading a checkpoint back into a live session is ``session.restore``'s job. Neither
touches a session: the engine (``TrainingSession``) hands ``write_checkpoint`` its
``CheckpointContents`` and applies what ``session.restore.read_checkpoint`` returns.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainwire.contract.config import TrainingConfig
from trainwire.contract.files import atomic_directory
from trainwire.server.engine.session.digest import update_with_tensors
from trainwire.server.engine.session.rng import RngState
from trainwire.server.engine.weights.tensor_files import load_tensors, save_tensors, write_json
from trainwire.server.errors import InvalidArgument, NotFound, ResourceExhausted, is_disk_full

CHECKPOINT_FORMAT = "trainwire.checkpoint/v1"
SESSION_FILE = "session.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
GRADIENTS_FILE = "gradients.safetensors"
RNG_FILE = "rng.safetensors"
LOSS_HOOK_FILE = "trainer.safetensors"  # named in format v1, before the hook was renamed
EXTRA_KEY = "extra"

Tensors = dict[str, torch.Tensor]
OptimizerState = dict[int, dict[str, torch.Tensor]]


# -- metadata ------------------------------------------------------------------------------------


def read_session_json(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's metadata; NotFound when there is no checkpoint there."""
    # Messages name the checkpoint, never the server's path to it: clients read them.
    meta_path = checkpoint / SESSION_FILE
    if not checkpoint.is_dir():
        raise NotFound(f"no checkpoint at {checkpoint.name}")
    if not meta_path.is_file():
        raise InvalidArgument(f"{checkpoint.name} is not a session checkpoint (no {SESSION_FILE})")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, RecursionError) as error:
        raise InvalidArgument(
            f"{checkpoint.name}/{SESSION_FILE}: not valid JSON ({error})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        raise InvalidArgument(f"{checkpoint.name}: not a {CHECKPOINT_FORMAT} checkpoint")
    return meta


def is_session_checkpoint(path: Path) -> bool:
    return (path / SESSION_FILE).is_file()


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path``'s ``session.json`` names the sharded format (``sharded.checkpoint``):
    the checkpoint readers the service calls (``read_extra``, ``verify_checkpoint``) hand
    those to ``sharded.verify``. Anything unreadable is left to ``read_session_json`` to name.
    """
    try:
        found = json.loads((path / SESSION_FILE).read_text()).get("format")
    except (OSError, ValueError, RecursionError, AttributeError):
        return False
    if found == CHECKPOINT_FORMAT:
        return False
    # Imported here, not at the top: the sharded format's modules import this one (for its
    # file names and keys), so this reader of either format imports them when it runs.
    from trainwire.server.engine.sharded.checkpoint import SHARDED_FORMAT

    return found == SHARDED_FORMAT


def read_extra(path: Path) -> dict[str, Any]:
    """A checkpoint's ``extra`` state without loading its tensors (either format)."""
    if is_sharded_checkpoint(path):
        from trainwire.server.engine.sharded.verify import read_sharded_extra  # see above

        return read_sharded_extra(path)
    return dict(read_session_json(path).get(EXTRA_KEY) or {})


def read_provenance(path: Path) -> dict[str, Any]:
    """What an export of this checkpoint's weights records about where they come from."""
    meta = read_session_json(path)
    return {key: meta.get(key) for key in ("base_model_fingerprint", "step", "state_digest")}


# -- optimizer state as flat tensors -----------------------------------------------------------


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> Tensors:
    """AdamW's per-parameter state as flat ``<index>.<name>`` tensors."""
    tensors = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            tensors[f"{index}.{name}"] = value
    return tensors


def optimizer_state_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: Tensors
) -> OptimizerState:
    """Check flat ``<index>.<name>`` tensors against the optimizer's parameters and return
    per-parameter state the optimizer may own, on each parameter's device.

    Owned copies, because a CPU tensor from ``load_file`` maps the checkpoint file, and a file
    rewritten in place after the load must never reach a live session.
    """
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state: OptimizerState = {}
    for key, value in sorted(tensors.items()):
        index, _, name = key.partition(".")
        if not index.isdigit() or int(index) >= len(parameters) or not name:
            raise InvalidArgument(
                f"the checkpoint's optimizer state {key!r} names a parameter this model lacks"
            )
        parameter = parameters[int(index)]
        if name == "step":  # AdamW keeps its step counts on the CPU and moves them itself
            state.setdefault(int(index), {})[name] = value.clone()
            continue
        if value.shape != parameter.shape or value.dtype != parameter.dtype:
            raise InvalidArgument(
                f"the checkpoint's optimizer state {key!r} is {value.dtype} "
                f"{tuple(value.shape)}; its parameter is {parameter.dtype} "
                f"{tuple(parameter.shape)}"
            )
        state.setdefault(int(index), {})[name] = value.to(parameter.device, copy=True)
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: OptimizerState) -> None:
    """Install checked per-parameter state; the groups' settings come from the (identical)
    config."""
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


# -- the state digest ----------------------------------------------------------------------------

DIGESTED_FILES = (MODEL_FILE, OPTIMIZER_FILE, GRADIENTS_FILE, LOSS_HOOK_FILE)  # in digest order


def continuation_digest(
    step: int,
    accumulated: int,
    max_steps: int | None,
    tensor_groups: Iterable[Tensors],
    rng: RngState,
) -> str:
    """The state digest over counters, tensor groups (in ``DIGESTED_FILES`` order) and RNG.

    One definition for the live session and for a checkpoint read back from its files, so a
    checkpoint can be verified without a session. The groups may be produced lazily: each is
    hashed and dropped before the next is read.
    """
    digest = hashlib.sha256(b"trainwire.state/v1|")
    digest.update(f"step={step}|accumulated={accumulated}|".encode())
    digest.update(f"max_steps={max_steps}|".encode())
    for tensors in tensor_groups:
        update_with_tensors(digest, tensors)
    rng.update_digest(digest)
    return "sha256:" + digest.hexdigest()


def verify_checkpoint(path: Path) -> str:
    """Check that checkpoint ``path`` is whole: every file loads and the state they hold hashes
    to the digest recorded when it was written. Returns that digest; ``InvalidArgument`` (or
    ``NotFound`` for a missing file) says what is damaged.

    Recovery runs this before it trusts a checkpoint, since a truncated or changed file would
    otherwise fail the restore (or, worse, restore other bits than the journal recorded). A
    sharded checkpoint is verified in this process, without a process group (``sharded.verify``).
    """
    if is_sharded_checkpoint(path):
        from trainwire.server.engine.sharded.verify import verify_sharded_checkpoint  # see above

        return verify_sharded_checkpoint(path)
    meta = read_session_json(path)
    recorded = meta.get("state_digest")
    try:
        rng = RngState.from_parts(meta["rng"], load_tensors(path / RNG_FILE))
        counters = (int(meta["step"]), int(meta["accumulated"]), meta.get("max_steps"))
    except (KeyError, TypeError, ValueError) as error:
        raise InvalidArgument(f"malformed {SESSION_FILE} or RNG state ({error!r})") from None
    groups = (load_tensors(path / name) for name in DIGESTED_FILES)
    found = continuation_digest(*counters, groups, rng)
    if found != recorded:
        raise InvalidArgument(
            f"its files hash to {found}, but it was written with state digest {recorded}"
        )
    return found


# -- writing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointContents:
    """A session's complete continuation state, as its checkpoint holds it (live tensors)."""

    config: TrainingConfig
    device_type: str
    step: int
    accumulated: int
    max_steps: int | None
    base_model_fingerprint: str | None
    loss_hook: str  # the hook's class name
    rng: RngState
    parameters: Tensors
    optimizer: Tensors
    gradients: Tensors
    loss_hook_state: Tensors

    def tensor_files(self) -> dict[str, Tensors]:
        """The tensors, grouped by the file they go to."""
        return {
            MODEL_FILE: self.parameters,
            OPTIMIZER_FILE: self.optimizer,
            GRADIENTS_FILE: self.gradients,
            RNG_FILE: self.rng.tensors(),
            LOSS_HOOK_FILE: self.loss_hook_state,
        }

    def state_digest(self) -> str:
        """sha256 over the whole continuation state (what ``TrainingSession.state_digest``
        reports): equal digests mean equal continuations."""
        groups = (self.parameters, self.optimizer, self.gradients, self.loss_hook_state)
        return continuation_digest(self.step, self.accumulated, self.max_steps, groups, self.rng)

    def metadata(self, state_digest: str, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "config_fingerprint": self.config.fingerprint(),
            "device_type": self.device_type,
            "step": self.step,
            "accumulated": self.accumulated,
            "max_steps": self.max_steps,
            "base_model_fingerprint": self.base_model_fingerprint,
            "trainer": self.loss_hook,
            "rng": self.rng.to_json(),
            "state_digest": state_digest,
            EXTRA_KEY: extra,
        }


def write_checkpoint(
    path: Path,
    contents: CheckpointContents,
    state_digest: Callable[[], str],
    extra: dict[str, Any],
) -> None:
    """Write ``contents`` to the checkpoint directory ``path``, atomically; a full disk is
    ``ResourceExhausted`` (an existing checkpoint at ``path`` stays as it was).

    ``state_digest`` is called on a helper thread while the files are written: the caller holds
    the session's lock, so nothing changes the state meanwhile.
    """
    # Serializing, syncing and hashing all release the GIL, so two helper threads write and sync
    # the files while a third computes the state digest from the same tensors. Two writers, not
    # five, bound the host memory a CUDA session's files take while in flight.
    try:
        _write_files(path, contents, state_digest, extra)
    except Exception as error:
        if not is_disk_full(error):
            raise
        raise ResourceExhausted(
            f"not enough disk space to write checkpoint {path.name} ({error}); nothing was "
            "replaced and the state is unchanged. Free space in the server's state directory "
            "(old runs, checkpoints, exports) and retry"
        ) from None


def _write_files(
    path: Path,
    contents: CheckpointContents,
    state_digest: Callable[[], str],
    extra: dict[str, Any],
) -> None:
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="trainwire-checkpoint") as pool:
        digest = pool.submit(state_digest)
        with atomic_directory(path) as tmp:
            writes = [
                pool.submit(save_tensors, tmp / name, tensors, sync=True)
                for name, tensors in contents.tensor_files().items()
            ]
            wait(writes)  # all of them, before a failure removes the directory they write into
            for write in writes:
                write.result()
            write_json(tmp / SESSION_FILE, contents.metadata(digest.result(), extra))
