"""A sharded session's checkpoint format and its digests (its weights alone, in and out, are
``sharded.weights``).

A sharded checkpoint is one directory, published atomically as a single-process one is::

    session.json     format, config and fingerprint, world size, counters, base-model
                     fingerprint, every rank's RNG, the tensors' layout, both digests, extra
    .metadata        torch.distributed.checkpoint's index of the shards
    __<rank>_*.distcp  each rank's shards of the parameters, AdamW moments, pending gradients

Every rank writes its shards into the same temporary directory (rank 0 makes it and names it
to the others); once ``dcp.save`` returns on every rank, every shard is written and indexed, and
rank 0 adds ``session.json``, syncs everything and renames the directory into place. Until that
rename nothing is there: a checkpoint counts only once every shard is durable. Tensors are keyed
by parameter name, so ``dcp.load`` reshards them to any world size.

Two digests. ``tensors_digest`` hashes the counters and every tensor gathered whole (in the
single-process checkpoint's names and order): it does not depend on the world size, and a load
on any world size checks it, which is how damage is found. ``state_digest`` adds the world size
and each rank's RNG: equal state digests mean equal continuations on that world size. Another
world size continues correctly, not bit for bit (the batch is split otherwise, so sums round
otherwise, and each rank draws from the RNG state of the rank it takes the place of).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainwire.contract.config import TrainingConfig
from trainwire.contract.files import atomic_directory
from trainwire.server.engine.loss.loss_hook import LossHook
from trainwire.server.engine.session.checkpoint import (
    EXTRA_KEY,
    SESSION_FILE,
    CheckpointContents,
    Tensors,
)
from trainwire.server.engine.session.digest import update_with_tensors
from trainwire.server.engine.session.restore import check_compatible
from trainwire.server.engine.session.rng import RngState
from trainwire.server.engine.sharded.sharding import ShardGroup, full_tensor, reshard
from trainwire.server.engine.weights.tensor_files import write_json
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound

SHARDED_FORMAT = "trainwire.sharded-checkpoint/v1"
MODEL_KEY, OPTIMIZER_KEY, GRADIENTS_KEY, LOSS_HOOK_KEY = "model", "optimizer", "gradients", "hook"


class _Whole(Mapping[str, torch.Tensor]):
    """Named tensors, each gathered whole when read (one at a time: memory for one tensor)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return full_tensor(self._tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Tensors:
    """AdamW's state as ``<parameter name>.<key>``: names, not indices, so it reshards."""
    reshard(model)  # the registered parameters are the optimizer's shards
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": value
        for p, state in optimizer.state.items()
        for key, value in state.items()
    }


@dataclass(frozen=True)
class ShardedContents:
    """A sharded session's complete continuation state, as its checkpoint holds it: one
    process's ``CheckpointContents`` holding this rank's shards (the optimizer's state by
    parameter name, ``optimizer_tensors``, so it reshards), and the group they belong to. Its
    digests are collectives (every rank computes them, in the same order)."""

    shards: ShardGroup
    state: CheckpointContents

    def tensors_digest(self) -> str:
        return self._tensors_digest

    @functools.cached_property
    def _tensors_digest(self) -> str:
        state = self.state
        groups = (state.parameters, state.optimizer, state.gradients, state.loss_hook_state)
        return sharded_tensors_digest(  # groups in DIGESTED_GROUPS order
            state.step, state.accumulated, state.max_steps, (_Whole(group) for group in groups)
        )

    def state_digest(self) -> str:
        fingerprints = self.shards.gather(self.state.rng.fingerprint())
        return sharded_state_digest(self.shards.world_size, self.tensors_digest(), fingerprints)


DIGESTED_GROUPS = (MODEL_KEY, OPTIMIZER_KEY, GRADIENTS_KEY, LOSS_HOOK_KEY)  # in digest order


def sharded_tensors_digest(
    step: int, accumulated: int, max_steps: int | None, groups: Iterable[Mapping[str, torch.Tensor]]
) -> str:
    """The tensors digest, one definition for a live session and its files (``sharded.verify``):
    the counters, then each group (``DIGESTED_GROUPS`` order) read one whole tensor at a time."""
    digest = hashlib.sha256(b"trainwire.sharded-tensors/v1|")
    digest.update(f"step={step}|accumulated={accumulated}|max_steps={max_steps}|".encode())
    for group in groups:
        update_with_tensors(digest, group)
    return "sha256:" + digest.hexdigest()


def sharded_state_digest(world_size: int, tensors: str, rng_fingerprints: Iterable[str]) -> str:
    """The state digest: world size, tensors digest, every rank's RNG in rank order."""
    digest = hashlib.sha256(b"trainwire.sharded-state/v1|")
    digest.update(f"world_size={world_size}|{tensors}|".encode())
    for fingerprint in rng_fingerprints:
        digest.update(fingerprint.encode())
    return "sha256:" + digest.hexdigest()


# -- saving ------------------------------------------------------------------------------------


def write_checkpoint(
    path: Path, contents: ShardedContents, state_digest: str, extra: dict[str, Any]
) -> None:
    """Every rank writes its shards of ``contents`` to the checkpoint directory ``path``, and
    rank 0 its ``session.json``; published once every rank's part succeeded (``publish``). The
    caller, on every rank, holds the session's lock."""
    shards, saved = contents.shards, contents.state
    state = {
        MODEL_KEY: {name: p.detach() for name, p in saved.parameters.items()},
        OPTIMIZER_KEY: saved.optimizer,
        GRADIENTS_KEY: saved.gradients,
        LOSS_HOOK_KEY: saved.loss_hook_state,
    }
    # One process's metadata, with every rank's RNG, the world size and the tensors' layout.
    meta = {
        **saved.metadata(state_digest, extra),
        "format": SHARDED_FORMAT,
        "world_size": shards.world_size,
        "rng": shards.gather(_rng_to_json(saved.rng)),
        "layout": {
            OPTIMIZER_KEY: _layout(saved.optimizer),
            GRADIENTS_KEY: sorted(saved.gradients),
            LOSS_HOOK_KEY: _layout(saved.loss_hook_state),
        },
        "tensors_digest": contents.tensors_digest(),
    }

    def write(tmp: Path) -> None:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=shards.group)
        if shards.rank == 0:
            write_json(tmp / SESSION_FILE, meta)

    publish(shards, path, write)


def publish(shards: ShardGroup, path: Path, write: Callable[[Path], None]) -> None:
    """Every rank runs ``write`` into one temporary directory; once all of them succeeded, rank
    0 syncs it and renames it to ``path``. Every rank raises if any part failed, so none goes
    on believing a checkpoint exists that does not."""
    if shards.rank != 0:
        tmp = shards.broadcast(None)
        failure: Exception | None = None
        if tmp is not None:
            try:
                _all_succeed(shards, path, lambda: write(Path(tmp)))
            except Exception as error:
                failure = error
        _raise_if_failed(shards.broadcast(None), path, failure)
        return
    announced = False
    try:
        with atomic_directory(path) as tmp:
            shards.broadcast(str(tmp))
            announced = True
            _all_succeed(shards, path, lambda: write(tmp))
    except Exception as error:
        if not announced:  # the others still wait for the directory's name
            shards.broadcast(None)
        shards.broadcast(_describe(error))
        raise
    shards.broadcast(None)


def on_rank_zero(shards: ShardGroup, path: Path, work: Callable[[], None]) -> None:
    """Rank 0 writes ``path`` alone; every rank raises if it failed."""
    failure: Exception | None = None
    if shards.rank == 0:
        try:
            work()
        except Exception as error:
            failure = error
    outcome = shards.broadcast(None if failure is None else _describe(failure))
    if failure is not None:
        raise failure
    _raise_if_failed(outcome, path, None)


def _all_succeed(shards: ShardGroup, path: Path, work: Callable[[], None]) -> None:
    """Run this rank's part, then raise on every rank if any rank's part failed."""
    failure: Exception | None = None
    try:
        work()
    except Exception as error:
        failure = error
    failures = [text for text in shards.gather(failure and _describe(failure)) if text]
    if failure is not None:
        raise failure
    if failures:
        raise FailedPrecondition(f"{path.name} was not written: {failures[0]}")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raise_if_failed(outcome: str | None, path: Path, cause: Exception | None) -> None:
    if outcome is not None:
        raise FailedPrecondition(f"{path.name} was not written: {outcome}") from cause
    if cause is not None:
        raise cause


def _layout(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """Each tensor's global shape and dtype: what a load allocates before reading into it."""
    return {
        name: [list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()
    }


def _rng_to_json(rng: RngState) -> dict[str, Any]:
    raw = {
        name: base64.b64encode(t.numpy().tobytes()).decode() for name, t in rng.tensors().items()
    }
    return {**rng.to_json(), "tensors": raw}


def rng_from_json(data: dict[str, Any]) -> RngState:
    tensors = {
        name: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
        for name, text in data["tensors"].items()
    }
    return RngState.from_parts(data, tensors)


# -- loading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedRestore:
    """A sharded checkpoint's metadata, read and checked against the live session, and the
    tensors its shards are read into; nothing loaded yet. ``dcp.load`` reads the parameters
    into the live ones themselves, so unlike one process's restore the tensors are checked
    only once loaded: by the tensors digest (``check``), under the caller's
    ``breaks_on_failure``."""

    path: Path
    shards: ShardGroup
    step: int
    accumulated: int
    base_model_fingerprint: str | None
    rng: RngState
    tensors_digest: str | None  # recorded when it was written
    state: dict[str, Tensors]
    extra: dict[str, Any]

    def loss_hook_state(self) -> Tensors:
        """The loss hook's tensors as allocated, not yet read: a hook that refuses them refuses
        before anything is loaded."""
        return dict(self.state[LOSS_HOOK_KEY])

    def load_into(
        self, live: Tensors, optimizer: torch.optim.Optimizer, loss_hook: LossHook
    ) -> None:
        """Read every rank's shards into the live parameters, the optimizer, the pending
        gradients and the loss hook (the caller marks a failure midway)."""
        dcp.load(
            self.state,
            storage_reader=dcp.FileSystemReader(self.path),
            process_group=self.shards.group,
        )
        loss_hook.load_session_state_dict(self.state[LOSS_HOOK_KEY])
        optimizer.state.clear()
        for key, value in self.state[OPTIMIZER_KEY].items():
            name, _, field = key.rpartition(".")
            optimizer.state[live[name]][field] = value
        for name, parameter in live.items():
            parameter.grad = self.state[GRADIENTS_KEY].get(name)

    def check(self, found: str) -> None:
        """InvalidArgument unless the loaded state's tensors digest is the recorded one."""
        if found != self.tensors_digest:
            raise InvalidArgument(
                f"checkpoint {self.path.name} is damaged: its shards hash to {found}, but it was "
                f"written with {self.tensors_digest}"
            )


def read_checkpoint(
    path: Path,
    shards: ShardGroup,
    *,
    config: TrainingConfig,
    device_type: str,
    max_steps: int | None,
    live: Tensors,
) -> ShardedRestore:
    """Read and check sharded checkpoint ``path``'s metadata against the live session's, and
    allocate what its shards are read into (sharded like each live parameter)."""
    meta = read_sharded_meta(path)
    check_compatible(meta, config, device_type, max_steps)
    try:
        saved_rngs = meta["rng"]
        # Same world size: each rank its own RNG. Another: the rank it takes the place of.
        rng = rng_from_json(saved_rngs[shards.rank % len(saved_rngs)])
        layout = meta["layout"]
        step, accumulated = int(meta["step"]), int(meta["accumulated"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise InvalidArgument(f"{path.name}: malformed {SESSION_FILE} ({error!r})") from None
    state = {
        MODEL_KEY: {name: p.detach() for name, p in live.items()},
        OPTIMIZER_KEY: {k: _empty(k, v, live) for k, v in layout[OPTIMIZER_KEY].items()},
        GRADIENTS_KEY: {name: torch.zeros_like(live[name]) for name in layout[GRADIENTS_KEY]},
        LOSS_HOOK_KEY: {k: _empty(k, v, {}) for k, v in layout[LOSS_HOOK_KEY].items()},
    }
    return ShardedRestore(
        path=path,
        shards=shards,
        step=step,
        accumulated=accumulated,
        base_model_fingerprint=meta.get("base_model_fingerprint"),
        rng=rng,
        tensors_digest=meta.get("tensors_digest"),
        state=state,
        extra=dict(meta.get(EXTRA_KEY) or {}),
    )


def read_sharded_meta(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``session.json``; NotFound or InvalidArgument saying why not."""
    if not (path / SESSION_FILE).is_file():
        raise NotFound(f"no checkpoint at {path.name}")
    try:
        meta = json.loads((path / SESSION_FILE).read_text())
    except (ValueError, RecursionError) as error:
        raise InvalidArgument(f"{path.name}/{SESSION_FILE}: not valid JSON ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARDED_FORMAT:
        raise InvalidArgument(
            f"{path.name}: not a {SHARDED_FORMAT} checkpoint; a sharded session loads only "
            "checkpoints of sharded sessions (any world size)"
        )
    return meta


def _empty(key: str, layout: list[Any], live: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Where ``key``'s tensor is read into: sharded like its parameter when it has one."""
    shape, dtype = layout
    owner = live.get(key.rpartition(".")[0])
    if owner is not None and list(owner.shape) == list(shape):
        return torch.zeros_like(owner.detach())
    return torch.zeros(shape, dtype=getattr(torch, dtype))
