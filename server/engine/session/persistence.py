"""A session's state in and out: its digest, its checkpoints, its weights.

``TrainingSession``'s persistence methods (``state_digest``, ``save_state``, ``load_state``,
``load_weights``, ``export_weights``, ``export_checkpoint_weights``) delegate here, one function
each, and keep their signatures and contracts in ``session``. The functions work on the session
as its own methods would, its guard included: each takes the session's lock first, so none runs
beside an operation. The checkpoint format they write and read is ``session.checkpoint`` and
``session.restore``; the weights sources and exports are ``weights``. A sharded session (one
with a process group) keeps its state in ``sharded.checkpoint`` instead, and its weights go in
and out through ``sharded.weights``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire.server.engine.session.checkpoint import (
    CheckpointContents,
    optimizer_state_tensors,
    write_checkpoint,
)
from trainwire.server.engine.session.operation_guard import OperationGuard
from trainwire.server.engine.session.restore import RestoredState, read_checkpoint
from trainwire.server.engine.sharded import checkpoint as sharded_checkpoint
from trainwire.server.engine.sharded import weights as sharded_weights
from trainwire.server.engine.weights import transfer as weights
from trainwire.server.errors import FailedPrecondition

if TYPE_CHECKING:
    import torch

    from trainwire.server.engine.session import TrainingSession


class StateDigests:
    """The session's state digest, cached per state version.

    Computing it hashes every parameter, optimizer moment and pending gradient, while ``Info``
    reports it after each operation and every checkpoint and export records it; so it is
    computed once per state. The guard's version keys it: every state-changing operation bumps
    the version, and a read-only one (forward, sample) leaves every bit as it found it.
    """

    def __init__(self, guard: OperationGuard) -> None:
        self._guard = guard
        self._cached: tuple[int, str] | None = None

    def known(self) -> str:
        """The digest if it is cached for the current state, else "" (no lock, no hashing)."""
        cached = self._cached
        return cached[1] if cached is not None and cached[0] == self._guard.version else ""

    def held(self, contents: Callable[[], CheckpointContents]) -> str:
        """The digest, hashing ``contents()`` unless it is cached, for a caller that holds the
        session's lock (or a helper thread working for one: a checkpoint hashes its contents
        while it writes them, under the lock its writer holds)."""
        value = self.known() or contents().state_digest()
        self._cached = (self._guard.version, value)
        return value

    def drop(self) -> None:
        self._cached = None


def checkpoint_contents(
    session: TrainingSession,
) -> CheckpointContents | sharded_checkpoint.ShardedState:
    """Everything ``save_state`` writes, as the session's live tensors (the caller holds the
    lock: the tensors are not copied, so nothing may change them while they are read). A
    sharded session's is its ``ShardedState``: its digests, which gather the shards."""
    if session.shards is not None:
        return sharded_checkpoint.ShardedState(session)
    return CheckpointContents(
        config=session.config,
        device_type=session.device.type,
        step=session.step,
        accumulated=session.accumulated,
        max_steps=session.max_steps,
        base_model_fingerprint=session.base_fingerprint,
        loss_hook=type(session.loss_hook).__name__,
        rng=session.rng_state,
        parameters=dict(session.model.named_parameters()),
        optimizer=optimizer_state_tensors(session.optimizer),
        gradients=session.pending_gradients(),
        loss_hook_state=session.loss_hook.session_state_dict(),
    )


def save_state(session: TrainingSession, path: Path, extra: dict[str, Any]) -> None:
    if session.shards is not None:
        return sharded_checkpoint.save_state(session, path, extra)
    guard = session._guard
    with guard.lock:
        # A broken session's tensors may be half changed: a checkpoint of them would restore a
        # state no run ever had.
        guard.refuse_if_broken("cannot save an unusable session")
        contents = checkpoint_contents(session)
        # The digest is hashed from these very tensors on a helper thread while the files are
        # written; the lock, held until both are done, keeps them still meanwhile.
        write_checkpoint(path, contents, lambda: session._digests.held(lambda: contents), extra)


def load_state(session: TrainingSession, path: Path) -> dict[str, Any]:
    if session.shards is not None:
        return sharded_checkpoint.load_state(session, path)
    guard = session._guard
    with guard.lock:
        # A broken session may always be restored: that is how it becomes usable again.
        if not guard.fresh and guard.broken is None:
            raise FailedPrecondition(
                f"load_state needs a fresh session; this one has applied {guard.version} "
                f"operation(s) (step {session.step}). Open a new session to restore"
            )
        live = dict(session.model.named_parameters())
        restored = read_checkpoint(
            path,
            config=session.config,
            device_type=session.device.type,
            max_steps=session.max_steps,
            live=live,
            optimizer=session.optimizer,
        )
        _apply_restored(session, restored, live)
        guard.restored()
        return restored.extra


def _apply_restored(
    session: TrainingSession, restored: RestoredState, live: dict[str, torch.Tensor]
) -> None:
    # Everything is read and checked; now apply it (the hook first: it may still refuse, and
    # nothing has changed yet when it does).
    session.loss_hook.load_session_state_dict(restored.loss_hook_state)
    # Half restored: refuse everything until a load_state succeeds (a retry still works).
    with session._guard.breaks_on_failure("load_state"):
        restored.apply_tensors(live, session.optimizer)
    for name, parameter in live.items():
        parameter.grad = restored.gradients.get(name)
    session.step = restored.step
    session.accumulated = restored.accumulated
    session.base_fingerprint = restored.base_model_fingerprint
    session._guard.rng = restored.rng


def load_weights(session: TrainingSession, path: Path) -> None:
    if session.shards is not None:
        return sharded_weights.load_weights(session, path)
    guard = session._guard
    with guard.operation():
        # Read and check everything first; then apply, and a failure midway (out of memory,
        # say) marks the session unusable rather than leaving half the weights copied.
        load = weights.plan_weights_load(
            session.model, path, session.config, session.base_fingerprint
        )
        with guard.breaks_on_failure("load_weights"):
            load.apply(session.model)
        # A full model may have seeded a LoRA session's base: adapters and exports from now on
        # belong to these base weights.
        session.base_fingerprint = weights.base_model_fingerprint(session.model, session.config)
        guard.changed()


def export_weights(session: TrainingSession, path: Path) -> None:
    guard = session._guard
    with guard.lock:
        guard.refuse_if_broken("cannot export an unusable session")
        # Where the weights come from, in the export's record: the state digest names the exact
        # state they were exported from (a checkpoint of it records the same digest).
        provenance = {
            "base_model_fingerprint": session.base_fingerprint,
            "step": session.step,
            "state_digest": session.state_digest(),
        }
        if session.shards is not None:
            sharded_weights.export_weights(session, path, provenance)
            return
        weights.write_export(path, session.model, session.tokenizer, session.config, provenance)


def export_checkpoint_weights(session: TrainingSession, checkpoint: Path, path: Path) -> None:
    if session.shards is not None:
        return sharded_weights.export_checkpoint_weights(session, checkpoint, path)
    with session._guard.lock:  # no operation changes the model while it is copied
        # The checkpoint's weights go into a detached CPU copy, never into the live model: the
        # live state stays untouched even if the export fails midway.
        detached = copy.deepcopy(session.model).to("cpu")
        weights.export_checkpoint(checkpoint, path, detached, session.tokenizer, session.config)
