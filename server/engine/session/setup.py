"""What a ``TrainingSession`` checks before it allocates anything, the group it runs on, and the
parts of its set-up that depend on the device or the group.

Kept apart from ``session`` so its constructor reads as the lifecycle's set-up step: validate
(here), load, wrap, build the optimizer. A refused session allocates nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwire.contract.config import TrainingConfig
from trainwire.server.engine.device import refuse_unsupported_setups
from trainwire.server.engine.sampling.sampler import Sampler
from trainwire.server.engine.session.operation_guard import OperationGuard
from trainwire.server.engine.session.rng import RngState
from trainwire.server.engine.sharded.sharding import ShardGroup, shard_model
from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import InvalidArgument

logger = logging.getLogger("trainwire.server.engine.session")  # where a reader looks for it


def check_session_arguments(
    config: TrainingConfig, max_steps: int | None, process_group: dist.ProcessGroup | None
) -> ShardGroup | None:
    """InvalidArgument for a session that cannot be built; the group it runs on (None: one
    process). Without a group, a distributed launcher or an initialized default group is
    refused: one process must not silently train on a part of a group's work."""
    if not isinstance(config, TrainingConfig):
        raise InvalidArgument(f"config must be a TrainingConfig, got {type(config).__name__}")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise InvalidArgument(f"max_steps must be a positive integer or None, got {max_steps!r}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise InvalidArgument(
            f"process_group must be a torch.distributed ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    shards = ShardGroup.of(process_group)
    if shards is None:
        refuse_unsupported_setups()
    if max_steps is None and config.lr_scheduler != "constant":
        logger.warning(
            "lr_scheduler %r without max_steps: no horizon to decay over, so the rate holds "
            "at learning_rate after warmup; pass max_steps (a plan's max_steps) to decay",
            config.lr_scheduler,
        )
    return shards


def check_shared_base(
    base: SharedBase | None,
    config: TrainingConfig,
    model_dir: Path,
    device: torch.device,
    shards: ShardGroup | None,
) -> None:
    """InvalidArgument for a session that cannot run on the shared ``base`` (None: its own)."""
    if base is None:
        return
    if not isinstance(base, SharedBase):
        raise InvalidArgument(f"base must be a SharedBase or None, got {type(base).__name__}")
    if shards is not None:
        raise InvalidArgument(
            "a sharded session cannot run on a shared base: FSDP replaces the model's "
            "parameters with this rank's shards in place, which would take the base from the "
            "other runs on it; open it without a shared base"
        )
    base.refuse_unfit(config, model_dir, device)


def seeded_guard(seed: int, device: torch.device) -> OperationGuard:
    """The session's operation guard, its RNG seeded from ``seed``. CUDA is initialized first,
    so the snapshot holds the CUDA generators too; lazily initialized, they would take whatever
    seed came last."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.init()
    return OperationGuard(RngState.seeded(seed, cuda=cuda), cuda=cuda)


def shard_for_group(
    model: torch.nn.Module, tokenizer: Any, shards: ShardGroup | None, device: torch.device
) -> Sampler:
    """The session's sampler; with a group, the model is sharded too (FSDP2), and the sampler
    decodes on the shards with rank 0's draws (``batch_decode``), so every rank runs the same
    forwards. The sampler reads the vocabulary and positions before sharding (whole shapes)."""
    sampler = Sampler.for_model(model, tokenizer)
    if shards is None:
        return sampler
    shard_model(model, shards, device)
    sampler.agree = shards.from_rank_zero
    return sampler
