"""A sharded session's weights in and out: exports, a checkpoint's export, ``load_weights``.

Each function is the single-process one (``TrainingSession`` and ``weights.transfer``) with the
work placed on the ranks, calling the same checks and writers rather than defining its own:

- An export is written by rank 0 alone, from a fresh unsharded copy of the model on the CPU,
  with ``weights.write_export``: the directory one process writes, file for file.
  ``export_weights`` gathers the live weights into the copy; ``export_checkpoint_weights`` reads
  a checkpoint's into it (a sharded checkpoint's whole, one tensor at a time, with
  ``sharded.verify``'s one-process reading; one process's with ``weights.export_checkpoint``).
  The live state is untouched on every rank.
- ``load_weights``: every rank reads the whole source and checks it with the single-process
  checks (``weights.plan_weights_load``: names, shapes, dtypes, adapter settings, base model),
  against the live model, whose parameters have their whole shapes. The ranks then agree: if
  any refused, every rank raises, before any live tensor changes. Each rank then takes its own
  shard of every source tensor (``distribute_tensor`` slicing the whole tensor it holds, no
  communication) and copies it in with the single-process ``WeightsLoad.apply``. A source thus
  lives whole in CPU memory on every rank while it loads, as it does in one process.

Every rank returns or raises alike (``raise_alike``): a driver applies these on every rank in
lockstep, and a refusal must leave every rank at the same point (``lockstep``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from trainwire.contract.config import TrainingConfig
from trainwire.server import errors
from trainwire.server.engine.session.checkpoint import is_sharded_checkpoint, read_session_json
from trainwire.server.engine.sharded.checkpoint import on_rank_zero, read_sharded_meta
from trainwire.server.engine.sharded.sharding import ShardGroup, full_tensor
from trainwire.server.engine.sharded.verify import stored_parameters
from trainwire.server.engine.weights import transfer as weights
from trainwire.server.engine.weights.tensor_files import copy_into, describe_mismatches
from trainwire.server.errors import FailedPrecondition, InvalidArgument, TrainwireError

# What an export records of the checkpoint it was taken from, as ``read_provenance`` reads it.
PROVENANCE_KEYS = ("base_model_fingerprint", "step", "state_digest")


# -- exports -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportWriter:
    """How rank 0 writes an export as one process writes it: from ``cpu_copy()``, a fresh
    unsharded copy of the session's model on the CPU (the live one is sharded and may be on a
    GPU), with the session's tokenizer and config."""

    cpu_copy: Callable[[], torch.nn.Module]
    tokenizer: Any
    config: TrainingConfig

    def write(self, path: Path, model: torch.nn.Module, provenance: dict[str, Any]) -> None:
        weights.write_export(path, model, self.tokenizer, self.config, provenance)


def export_weights(
    shards: ShardGroup,
    model: torch.nn.Module,
    path: Path,
    provenance: dict[str, Any],
    writer: ExportWriter,
) -> None:
    """The full weights gathered to rank 0, written as the single-process export is, with the
    same ``provenance``. The caller holds the session's lock."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)  # rank 0 holds it

    def write() -> None:
        # The copy takes the gathered weights and writes them with the same code as a
        # single-process export (same files, same record).
        copy = writer.cpu_copy()
        copy.load_state_dict(full)
        writer.write(path, copy, provenance)

    on_rank_zero(shards, path, write)


def export_checkpoint_weights(
    shards: ShardGroup, checkpoint: Path, path: Path, writer: ExportWriter
) -> None:
    """Rank 0 exports ``checkpoint``'s weights (either format) from a copy; the other ranks wait
    and raise its error if it failed. The live state is untouched on every rank. The caller
    holds the session's lock, as in one process: no operation runs meanwhile."""
    failure: Exception | None = None
    if shards.rank == 0:
        try:
            _export_checkpoint(checkpoint, path, writer)
        except Exception as error:
            failure = error
    raise_alike(shards, failure)


def _export_checkpoint(checkpoint: Path, path: Path, writer: ExportWriter) -> None:
    if not is_sharded_checkpoint(checkpoint):
        # One process's checkpoint, exported as one process exports it: the copy stands in for
        # the detached live model (every parameter is overwritten). Its session.json is read
        # first, so a missing or foreign checkpoint is refused before the copy is built.
        read_session_json(checkpoint)
        model = writer.cpu_copy()
        weights.export_checkpoint(checkpoint, path, model, writer.tokenizer, writer.config)
        return
    meta = read_sharded_meta(checkpoint)
    model = writer.cpu_copy()
    copy_into(_checkpoint_pairs(dict(model.named_parameters()), checkpoint))
    provenance = {key: meta.get(key) for key in PROVENANCE_KEYS}
    provenance["checkpoint"] = checkpoint.name  # the name, as one process records it
    writer.write(path, model, provenance)


def _checkpoint_pairs(
    live: dict[str, torch.Tensor], checkpoint: Path
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter of ``live`` with sharded ``checkpoint``'s whole tensor, as one process's
    ``weights.plan_checkpoint_load`` pairs them: names, shapes and dtypes checked against the
    shard index before a single tensor is read, then every tensor read."""
    stored = stored_parameters(checkpoint)
    problems = describe_mismatches(live, stored.placeholders())
    if problems:
        raise InvalidArgument(f"checkpoint {checkpoint.name} does not fit this model: {problems}")
    return [(parameter, stored[name]) for name, parameter in live.items()]


# -- load_weights ------------------------------------------------------------------------------
# Every rank reads and checks the whole source (``plan_load``); once all agree (``agreed_load``),
# each copies its shards in.


def agreed_load(
    shards: ShardGroup, model: torch.nn.Module, plan: Callable[[], weights.WeightsLoad]
) -> tuple[weights.WeightsLoad, weights.WeightsLoad]:
    """``plan()`` on every rank (the source read whole and checked against ``model``, resharded
    first), the ranks agreed on it (if any refused, every rank raises: ``raise_alike``), and
    this rank's shards of it: (the whole load, the load in shards). Nothing has changed yet.
    A collective: ``load_weights`` and sampling other weights (``TrainingSession.sample``) both
    call it on every rank."""
    failure: Exception | None = None
    planned: tuple[weights.WeightsLoad, weights.WeightsLoad] | None = None
    try:
        load = plan()
        planned = load, _in_shards(load, model)
    except Exception as error:
        failure = error
    raise_alike(shards, failure)
    assert planned is not None  # raise_alike raised otherwise
    return planned


def plan_load(
    model: torch.nn.Module, path: Path, config: TrainingConfig, base_fingerprint: str | None
) -> weights.WeightsLoad:
    """The source read whole and checked against the live model, as one process checks it."""
    if not is_sharded_checkpoint(path):
        return weights.plan_weights_load(model, path, config, base_fingerprint)
    weights.check_saved_settings(path.name, read_sharded_meta(path).get("config"), config)
    live = dict(model.named_parameters())
    return weights.WeightsLoad(pairs=_checkpoint_pairs(live, path))


def _in_shards(load: weights.WeightsLoad, model: torch.nn.Module) -> weights.WeightsLoad:
    """``load`` with each whole source tensor replaced by this rank's shard of it, shaped like
    its live parameter, so the single-process ``apply`` copies shard into shard. Made before
    anything is applied: running out of memory here changes nothing."""
    if load.adapter:
        from peft import get_peft_model_state_dict

        # The live adapter under the adapter file's names (the names ``apply`` maps back).
        live = get_peft_model_state_dict(model)
        adapter = {name: _shard_like(tensor, live[name]) for name, tensor in load.adapter.items()}
        return weights.WeightsLoad(adapter=adapter)
    pairs = [(parameter, _shard_like(source, parameter)) for parameter, source in load.pairs]
    return weights.WeightsLoad(pairs=pairs)


def _shard_like(whole: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole``, placed as ``live`` is (sliced locally: every rank holds
    ``whole``, so nothing is sent)."""
    if not isinstance(live, DTensor):
        return whole
    part = distribute_tensor(whole, live.device_mesh, live.placements, src_data_rank=None)
    # On a GPU mesh the whole tensor is moved there first and the part is a view of it: a copy
    # lets the whole go, so the GPU holds one whole tensor at a time, never the whole source.
    return part if part.device == whole.device else part.clone()


def base_fingerprint_after(
    model: torch.nn.Module,
    load: weights.WeightsLoad,
    config: TrainingConfig,
    base_fingerprint: str | None,
) -> str | None:
    """``weights.base_model_fingerprint`` of the model as the load leaves it. An adapter holds
    no base weight (only the tensors of ``get_peft_model_state_dict``, which the fingerprint
    leaves out), so it keeps the base's; otherwise the fingerprint reads each parameter whole:
    the source's tensor where the load replaces it, else the live one gathered."""
    if load.adapter:
        return base_fingerprint
    sources = {id(live): source for live, source in load.pairs}
    return weights.base_model_fingerprint(_WholeModel(model, sources), config)


class _WholeModel:
    """What ``base_model_fingerprint`` reads of a model, ``named_parameters``, with every
    parameter whole: from ``sources`` (by live parameter) where given, else gathered."""

    def __init__(self, model: torch.nn.Module, sources: dict[int, torch.Tensor]) -> None:
        self._model, self._sources = model, sources

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in self._model.named_parameters():
            source = self._sources.get(id(parameter))
            yield name, full_tensor(parameter.detach()) if source is None else source


# -- agreeing on an outcome --------------------------------------------------------------------


def raise_alike(shards: ShardGroup, failure: Exception | None) -> None:
    """Every rank raises if any rank's part failed (a collective: every rank calls it). A rank
    that failed raises its own error; the others the first failed rank's, remade with its class
    and message where it is one of trainwire's refusals, so every rank answers a refusal alike.
    """
    outcomes = shards.gather(None if failure is None else (type(failure).__name__, str(failure)))
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            raise remade_error(rank, *outcome)


def remade_error(rank: int, class_name: str, message: str) -> Exception:
    """Rank ``rank``'s error, by its class's name and its message, as this rank raises it."""
    found = getattr(errors, class_name, None)
    if isinstance(found, type) and issubclass(found, TrainwireError):
        try:
            return found(message)
        except TypeError:  # a class that takes more than a message
            pass
    return FailedPrecondition(f"rank {rank} failed: {class_name}: {message}")
