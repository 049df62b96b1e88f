"""One session across a process group: FSDP2 wrapping, the batch split and the whole-batch loss.

Every rank builds the same ``TrainingSession`` with the same group and calls the same operation
with the same arguments; what differs between ranks is decided here, from the rank and world
size alone, so a driver only has to send every rank the same operation:

- The model: ``fully_shard`` on each decoder layer (the modules the architecture names in
  ``_no_split_modules``) and on the root, full weights or the PEFT adapter alike. Gradients are
  summed across ranks, never averaged: each rank's loss is already its share of the whole
  batch's loss (below), so their sum is the loss one process computes.
- The batch: contiguous slices of the examples in order (``ShardGroup.rows``), the first
  ``n % world_size`` ranks one example more. Every rank encodes the whole batch first, so a bad
  example is refused identically on every rank, before any collective.
- The loss: a text batch's native loss is a mean (over label tokens for causal-lm, over examples
  for classification); each rank scales its own mean by its share of that count, taken from the
  whole batch every rank holds, so the shares add up to the whole batch's mean. Token losses are
  sums, and add up as they are. A rank left without examples (a batch smaller than the group)
  still runs the collectives FSDP needs, on a stand-in example whose loss counts zero.
- The results: loss, predictions, logprobs and metrics are gathered in rank order and combined
  the same way on every rank (a metric by the reduction its name ends in: ``:sum``, ``:mean``
  weighted by tokens, ``:max``, ``:min``), so every rank returns the same value.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainwire.server.engine.loss.batching import IGNORE_INDEX, BatchEncoder
from trainwire.server.engine.loss.loss_hook import LossHook
from trainwire.server.engine.loss.microbatches import (
    Microbatch,
    TextMicrobatch,
    TokenMicrobatch,
    encode_microbatch,
)
from trainwire.server.engine.session.results import ForwardResult, TokenOutput
from trainwire.server.errors import FailedPrecondition


@dataclass(frozen=True)
class ShardGroup:
    """The process group a session runs across, with the rule that splits a batch over it."""

    group: dist.ProcessGroup
    rank: int
    world_size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> ShardGroup | None:
        """None for no group: the single-process session."""
        if group is None:
            return None
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def rows(self, count: int) -> range:
        """This rank's examples of a batch of ``count``: a contiguous slice, in order."""
        base, extra = divmod(count, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def from_rank_zero(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (the same shape and dtype on every rank, on the
        device the group's backend sends from): a decision rank 0 made becomes the group's, so
        the ranks cannot part ways on it."""
        tensor = tensor.contiguous()  # a collective sends contiguous memory
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tensor


def shard_model(model: torch.nn.Module, shards: ShardGroup, device: torch.device) -> None:
    """FSDP2 in place: each decoder layer, then the root (which takes what is left: embeddings,
    the final norm, the head). Frozen base weights and trainable adapters shard alike."""
    mesh = DeviceMesh.from_group(shards.group, device.type)
    layer_names = set(_no_split_modules(model))
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise FailedPrecondition(
            f"{type(model).__name__} names no decoder layer (_no_split_modules) to shard"
        )
    policy = precision_policy(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum, not average: every rank's loss is its share of the whole batch's. A plain
            # SUM collective with no factor (gloo has no PREMUL_SUM or AVG), on every backend.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def precision_policy(model: torch.nn.Module) -> MixedPrecisionPolicy:
    """bf16 weights reduce their gradients in fp32: a sum over ranks in bf16 would round at
    every addition, which one process never does. fp32 weights keep FSDP's default (no cast),
    so the CPU path computes exactly what it did before."""
    if any(p.dtype == torch.bfloat16 for p in model.parameters()):
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP group back to its shards. FSDP2 keeps the root's weights gathered after a
    forward, for the backward that usually follows; after a forward alone they would stay
    gathered, and the parameters the optimizer, the digest and checkpoints read (the shards)
    would not be the module's registered ones until the next backward."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def resharded_after(model: torch.nn.Module, shards: ShardGroup | None) -> Iterator[None]:
    """Every FSDP module back to its shards after the block (a forward alone leaves the root's
    weights gathered, ``reshard``); nothing without a group."""
    try:
        yield
    finally:
        if shards is not None:
            reshard(model)


def _no_split_modules(model: torch.nn.Module) -> list[str]:
    names: list[str] = []
    for module in model.modules():
        names.extend(getattr(module, "_no_split_modules", None) or [])
    return names


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank calls it in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def total_norm(gradients: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over every rank's gradient shards: one number, the same on every rank."""
    return full_tensor(torch.nn.utils.get_total_norm(gradients))


# -- one microbatch, split ------------------------------------------------------------------------


@dataclass
class ShardedMicrobatch:
    """This rank's slice of a microbatch, with its share of the whole batch's loss."""

    local: Microbatch
    shards: ShardGroup
    token_count: int  # the whole batch's (throughput figures)
    example_count: int  # this rank's real examples (0: it runs a stand-in)
    scale: float  # this rank's share of the whole batch's loss

    def loss(self, model: torch.nn.Module, hook: LossHook, *, training: bool) -> torch.Tensor:
        loss = self.local.loss(model, hook, training=training) * self.scale
        if not training:
            reshard(model)  # no backward follows to do it
        if isinstance(self.local, TokenMicrobatch):
            try:  # a metric no rank can combine: refused here, before any backward
                combine_metrics([(self.local._metrics, 0)])
            except FailedPrecondition:
                reshard(model)
                raise
        return loss

    def forward_result(self, loss: torch.Tensor) -> ForwardResult | TokenOutput:
        return self._combine(self.local.forward_result(loss))

    def backward_result(self, loss: torch.Tensor) -> float | TokenOutput:
        return self._combine(self.local.backward_result(loss))

    def _combine(self, result: Any) -> Any:
        real = self.example_count > 0
        parts = self.shards.gather((result, self.local.token_count if real else 0, real))
        kept = [(part, weight) for part, weight, counted in parts if counted]
        if isinstance(result, TokenOutput):
            return TokenOutput(
                sum(part.loss for part, _, _ in parts),  # the stand-in's share is zero
                [row for part, _ in kept for row in part.logprobs],
                combine_metrics([(part.metrics, weight) for part, weight in kept]),
            )
        if isinstance(result, ForwardResult):
            predictions = [p for part, _ in kept for p in part.predictions]
            return ForwardResult(sum(part.loss for part, _, _ in parts), predictions)
        return sum(parts_loss for parts_loss, _, _ in parts)


def combine_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Each rank's metrics into the whole batch's, by the reduction each name ends in.

    A ``:mean`` is weighted by the tokens behind it; a reduction not known here is refused
    rather than guessed (a custom loss hook's metric says how it combines by its name)."""
    out: dict[str, float] = {}
    names = sorted({name for metrics, _ in parts for name in metrics})
    for name in names:
        values = [(metrics[name], weight) for metrics, weight in parts if name in metrics]
        reduction = name.rpartition(":")[2]
        if reduction == "sum":
            out[name] = sum(value for value, _ in values)
        elif reduction == "mean":
            total = sum(weight for _, weight in values)
            out[name] = sum(value * weight for value, weight in values) / max(total, 1)
        elif reduction in ("max", "min"):
            out[name] = (max if reduction == "max" else min)(value for value, _ in values)
        else:
            raise FailedPrecondition(
                f"metric {name!r}: no known reduction (:sum, :mean, :max, :min) to combine it "
                "across ranks"
            )
    return out


def encode_for_group(
    examples: Sequence[Any],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    encoder: BatchEncoder,
    vocab_size: int,
    shards: ShardGroup | None,
) -> Microbatch | ShardedMicrobatch:
    """The batch as this rank trains on it: the whole microbatch without a group, else this
    rank's slice. The whole batch is encoded and checked on every rank either way, so a bad
    example is refused alike everywhere, before any collective."""
    encode = functools.partial(
        encode_microbatch,
        loss_fn=loss_fn,
        loss_fn_config=loss_fn_config,
        encoder=encoder,
        vocab_size=vocab_size,
    )
    whole = encode(examples)
    return whole if shards is None else split_microbatch(whole, examples, shards, encode)


def split_microbatch(
    whole: Microbatch, examples: Sequence[Any], shards: ShardGroup, encode: Any
) -> ShardedMicrobatch:
    """This rank's slice of ``examples`` (already encoded and checked whole as ``whole``),
    encoded by ``encode`` and weighted by its share of the whole batch's loss."""
    rows = shards.rows(len(examples))
    local_examples = [examples[i] for i in rows] or [examples[0]]  # a stand-in: counts zero
    local = encode(local_examples)
    if not rows:
        scale = 0.0
    elif isinstance(whole, TextMicrobatch):
        scale = _loss_count(local) / max(_loss_count(whole), 1)
    else:
        scale = 1.0  # token losses are sums over tokens
    return ShardedMicrobatch(local, shards, whole.token_count, len(rows), scale)


def _loss_count(microbatch: TextMicrobatch) -> int:
    """What a text batch's native loss averages over: label tokens after the shift (causal-lm,
    as transformers' ``ForCausalLMLoss`` counts them) or examples (classification)."""
    labels = microbatch.batch.inputs["labels"]
    if microbatch.config.task == "causal-lm":
        return int((labels[:, 1:] != IGNORE_INDEX).sum())
    return microbatch.batch.example_count
