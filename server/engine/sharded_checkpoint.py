"""A sharded session's state in and out: its digest and its checkpoints (its weights alone, in
and out, are ``sharded_weights``).

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
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from trainwire.contract.files import atomic_directory
from trainwire.server.engine.digest import update_with_tensors
from trainwire.server.engine.rng import RngState
from trainwire.server.engine.session_checkpoint import EXTRA_KEY, SESSION_FILE
from trainwire.server.engine.session_restore import check_compatible
from trainwire.server.engine.sharding import ShardGroup, full_tensor, reshard
from trainwire.server.engine.tensor_files import write_json
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound

if TYPE_CHECKING:
    from trainwire.server.engine.session import TrainingSession

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


def _optimizer_tensors(session: TrainingSession) -> dict[str, torch.Tensor]:
    """AdamW's state as ``<parameter name>.<key>``: names, not indices, so it reshards."""
    reshard(session.model)  # the registered parameters are the optimizer's shards
    names = {id(p): name for name, p in session.model.named_parameters()}
    return {
        f"{names[id(p)]}.{key}": value
        for p, state in session.optimizer.state.items()
        for key, value in state.items()
    }


class ShardedState:
    """A sharded session's digests; computing them is a collective (every rank, same order)."""

    def __init__(self, session: TrainingSession) -> None:
        self.session = session
        self._tensors: str | None = None

    def tensors_digest(self) -> str:
        if self._tensors is None:
            session = self.session
            groups = (  # in DIGESTED_GROUPS order
                dict(session.model.named_parameters()),
                _optimizer_tensors(session),
                session.pending_gradients(),
                session.loss_hook.session_state_dict(),
            )
            self._tensors = sharded_tensors_digest(
                session.step,
                session.accumulated,
                session.max_steps,
                (_Whole(group) for group in groups),
            )
        return self._tensors

    def state_digest(self) -> str:
        shards = _shards(self.session)
        fingerprints = shards.gather(self.session.rng_state.fingerprint())
        return sharded_state_digest(shards.world_size, self.tensors_digest(), fingerprints)


DIGESTED_GROUPS = (MODEL_KEY, OPTIMIZER_KEY, GRADIENTS_KEY, LOSS_HOOK_KEY)  # in digest order


def sharded_tensors_digest(
    step: int, accumulated: int, max_steps: int | None, groups: Iterable[Mapping[str, torch.Tensor]]
) -> str:
    """The tensors digest, one definition for a live session and its files (``sharded_verify``):
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


def _shards(session: TrainingSession) -> ShardGroup:
    assert session.shards is not None
    return session.shards


# -- saving ------------------------------------------------------------------------------------


def save_state(session: TrainingSession, path: Path, extra: dict[str, Any]) -> None:
    shards, guard = _shards(session), session._guard
    with guard.lock:
        guard.refuse_if_broken("cannot save an unusable session")
        contents = ShardedState(session)
        state_digest = session._digests.held(lambda: contents)
        optimizer = _optimizer_tensors(session)
        gradients = session.pending_gradients()
        hook = session.loss_hook.session_state_dict()
        state = {
            MODEL_KEY: {name: p.detach() for name, p in session.model.named_parameters()},
            OPTIMIZER_KEY: optimizer,
            GRADIENTS_KEY: gradients,
            LOSS_HOOK_KEY: hook,
        }
        meta = {
            "format": SHARDED_FORMAT,
            "config": session.config.to_dict(),
            "config_fingerprint": session.config.fingerprint(),
            "device_type": session.device.type,
            "world_size": shards.world_size,
            "step": session.step,
            "accumulated": session.accumulated,
            "max_steps": session.max_steps,
            "base_model_fingerprint": session.base_fingerprint,
            "trainer": type(session.loss_hook).__name__,
            "rng": shards.gather(_rng_to_json(session.rng_state)),
            "layout": {
                OPTIMIZER_KEY: _layout(optimizer),
                GRADIENTS_KEY: sorted(gradients),
                LOSS_HOOK_KEY: _layout(hook),
            },
            "tensors_digest": contents.tensors_digest(),
            "state_digest": state_digest,
            EXTRA_KEY: extra,
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


def load_state(session: TrainingSession, path: Path) -> dict[str, Any]:
    shards, guard = _shards(session), session._guard
    with guard.lock:
        if not guard.fresh and guard.broken is None:
            raise FailedPrecondition(
                f"load_state needs a fresh session; this one has applied {guard.version} "
                f"operation(s) (step {session.step}). Open a new session to restore"
            )
        meta = read_sharded_meta(path)
        check_compatible(meta, session.config, session.device.type, session.max_steps)
        try:
            saved_rngs = meta["rng"]
            # Same world size: each rank its own RNG. Another: the rank it takes the place of.
            rng = rng_from_json(saved_rngs[shards.rank % len(saved_rngs)])
            layout = meta["layout"]
            step, accumulated = int(meta["step"]), int(meta["accumulated"])
        except (KeyError, TypeError, ValueError, IndexError) as error:
            raise InvalidArgument(f"{path.name}: malformed {SESSION_FILE} ({error!r})") from None
        live = dict(session.model.named_parameters())
        state = {
            MODEL_KEY: {name: p.detach() for name, p in live.items()},
            OPTIMIZER_KEY: {k: _empty(k, v, live) for k, v in layout[OPTIMIZER_KEY].items()},
            GRADIENTS_KEY: {name: torch.zeros_like(live[name]) for name in layout[GRADIENTS_KEY]},
            LOSS_HOOK_KEY: {k: _empty(k, v, {}) for k, v in layout[LOSS_HOOK_KEY].items()},
        }
        session.loss_hook.load_session_state_dict(dict(state[LOSS_HOOK_KEY]))  # may refuse
        # dcp.load reads into the live parameters themselves: from here a failure, or files
        # that do not hash to what was written, leave the session broken until a load_state.
        with guard.breaks_on_failure("load_state"):
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=shards.group)
            session.loss_hook.load_session_state_dict(state[LOSS_HOOK_KEY])
            _install(session, live, state[OPTIMIZER_KEY], state[GRADIENTS_KEY])
            session.step, session.accumulated = step, accumulated
            session.base_fingerprint = meta.get("base_model_fingerprint")
            guard.rng = rng
            found = ShardedState(session).tensors_digest()
            if found != meta.get("tensors_digest"):
                raise InvalidArgument(
                    f"checkpoint {path.name} is damaged: its shards hash to {found}, but it was "
                    f"written with {meta.get('tensors_digest')}"
                )
        guard.restored()
        return dict(meta.get(EXTRA_KEY) or {})


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


def _install(
    session: TrainingSession,
    live: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    gradients: dict[str, torch.Tensor],
) -> None:
    session.optimizer.state.clear()
    for key, value in optimizer.items():
        name, _, field = key.rpartition(".")
        session.optimizer.state[live[name]][field] = value
    for name, parameter in live.items():
        parameter.grad = gradients.get(name)
