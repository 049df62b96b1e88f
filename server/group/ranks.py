"""Which rank this process is, its device, and joining the group.

A launcher says who is who through the environment torchrun defines: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. ``trainwire serve --nproc N`` sets the same
variables for the N processes it starts (``supervisor``), so one path serves both.

Two process groups. The world group carries the session's collectives (FSDP's all-gathers and
reduce-scatters, digests, checkpoints): gloo on the CPU, NCCL for CUDA tensors with gloo beside it
for the CPU objects the engine gathers. The control group carries rank 0's announcements
(``channel``): always gloo, with a timeout long enough that the other ranks may wait for the next
operation as long as a server stays idle; a rank that dies closes its sockets, so the others
hear of it at once rather than at the timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from trainwire.server.engine.device import resolve_device
from trainwire.server.group.channel import BroadcastChannel
from trainwire.server.group.launch import Launch

# How long the other ranks may wait for rank 0's next announcement: an idle server's ranks
# wait here, so it bounds nothing a user would notice (a dead rank is heard of at once).
CONTROL_TIMEOUT = datetime.timedelta(days=365)


def rank_device(requested: str | None, launch: Launch) -> torch.device:
    """One device per rank: ``cuda`` (or none given, on a machine with CUDA) is the local rank's
    GPU; ``cuda:N`` would put every rank of a node on one GPU, so it is refused."""
    device = resolve_device(requested)
    if device.type != "cuda":
        return device
    if requested not in (None, "cuda") and launch.world_size > 1:
        raise ValueError(
            f"--device {requested}: each rank takes its local rank's GPU; give --device cuda"
        )
    if launch.local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK {launch.local_rank}: this node has {torch.cuda.device_count()} GPUs"
        )
    torch.cuda.set_device(launch.local_rank)
    return torch.device("cuda", launch.local_rank)


@dataclass(frozen=True)
class RankGroup:
    """The joined group: this rank, its device, the session's group and rank 0's channel."""

    launch: Launch
    device: torch.device
    world: dist.ProcessGroup
    channel: BroadcastChannel


def join_group(launch: Launch, requested_device: str | None) -> RankGroup:
    """Join the world and control groups (blocks until every rank has joined)."""
    device = rank_device(requested_device, launch)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method="env://", rank=launch.rank, world_size=launch.world_size
    )
    world = dist.group.WORLD
    assert world is not None
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return RankGroup(launch, device, world, BroadcastChannel(control))


def leave_group() -> None:
    """Tear the process groups down (at a clean stop; a dead group needs no goodbye)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_group_and_exit(code: int) -> NoReturn:
    """Leave the group and end the process with ``code`` at once, past the interpreter's
    finalization: gloo's worker threads may still hold objects whose release at that point
    aborts the process (SIGABRT, "terminate called without an active exception"), which would
    turn a clean stop into a failure the supervisor or torchrun acts on. Everything a rank keeps
    is on disk by now (the journal commits before answering); the logs are flushed first."""
    leave_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
