"""A sharded checkpoint read back in one process, with no process group: verified, its extra,
its parameters.

The service reads its checkpoints without a session (recovery picks the newest one that
verifies, and reads the journal entry its ``extra`` carries), and a sharded session's checkpoints
must pass the same test as a single-process one's. ``torch.distributed.checkpoint`` loads without
a process group (``dcp.load(..., no_dist=True)``: this process reads every rank's shards), so
each tensor is read whole into a plain tensor allocated from the checkpoint's layout, hashed,
and dropped before the next: memory for one whole tensor, never the whole state.

The tensors hash with ``sharded_tensors_digest`` (the live session's definition), and the state
digest is recomputed from them, the world size and every rank's recorded RNG; a checkpoint
verifies only when both equal what it was written with.

``stored_parameters`` reads the parameters the same way, whole, one at a time, for what takes a
checkpoint's weights alone (``sharded.weights``: an export of them, ``load_weights``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainwire.server.engine.session.checkpoint import EXTRA_KEY, SESSION_FILE
from trainwire.server.engine.sharded.checkpoint import (
    DIGESTED_GROUPS,
    GRADIENTS_KEY,
    LOSS_HOOK_KEY,
    MODEL_KEY,
    OPTIMIZER_KEY,
    read_sharded_meta,
    rng_from_json,
    sharded_state_digest,
    sharded_tensors_digest,
)
from trainwire.server.errors import InvalidArgument

Layout = dict[str, tuple[list[int], torch.dtype]]  # a group's tensors: name -> (shape, dtype)


def read_sharded_extra(path: Path) -> dict[str, Any]:
    """A sharded checkpoint's ``extra`` state, from its ``session.json`` alone."""
    return dict(read_sharded_meta(path).get(EXTRA_KEY) or {})


def verify_sharded_checkpoint(path: Path) -> str:
    """Check that sharded checkpoint ``path`` is whole, in this process, with no process group:
    every shard reads and the tensors hash to the digest recorded when it was written, and
    with the world size and every rank's RNG to the recorded state digest. Returns that
    state digest; ``InvalidArgument`` names the checkpoint and what is damaged, ``NotFound``
    says there is no checkpoint.
    """
    meta = read_sharded_meta(path)
    try:
        counters = (int(meta["step"]), int(meta["accumulated"]), meta.get("max_steps"))
        world_size = int(meta["world_size"])
        fingerprints = [rng_from_json(rng).fingerprint() for rng in meta["rng"]]
        recorded_tensors, recorded_state = meta["tensors_digest"], meta["state_digest"]
        layout = meta["layout"]
        saved = {
            OPTIMIZER_KEY: _saved_layout(layout[OPTIMIZER_KEY]),
            GRADIENTS_KEY: list(layout[GRADIENTS_KEY]),
            LOSS_HOOK_KEY: _saved_layout(layout[LOSS_HOOK_KEY]),
        }
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as error:
        raise InvalidArgument(f"{path.name}: malformed {SESSION_FILE} ({error!r})") from None
    if len(fingerprints) != world_size:
        raise InvalidArgument(
            f"{path.name}: malformed {SESSION_FILE} (RNG states of {len(fingerprints)} rank(s) "
            f"for a world size of {world_size})"
        )
    reader = _IndexedReader(path, _read_index(path))
    layouts = _group_layouts(path, reader.index, saved)
    groups = (StoredGroup(reader, group, layouts[group]) for group in DIGESTED_GROUPS)
    found = sharded_tensors_digest(*counters, groups)
    if found != recorded_tensors:
        raise InvalidArgument(
            f"checkpoint {path.name} is damaged: its shards hash to {found}, but it was written "
            f"with {recorded_tensors}"
        )
    state = sharded_state_digest(world_size, found, fingerprints)
    if state != recorded_state:
        raise InvalidArgument(
            f"checkpoint {path.name} is damaged: its tensors, world size and RNG states hash to "
            f"{state}, but it was written with state digest {recorded_state}"
        )
    return state


def _saved_layout(entries: Mapping[str, Any]) -> Layout:
    """``session.json``'s layout of a group, as ``save_state`` wrote it: ``[shape, dtype]``."""
    layout: Layout = {}
    for name, (shape, dtype) in entries.items():
        found = getattr(torch, dtype)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{name}: {dtype!r} is no dtype")
        layout[name] = ([int(size) for size in shape], found)
    return layout


def _read_index(path: Path) -> Metadata:
    """DCP's index of the shards (``.metadata``: each tensor's global shape, dtype, chunks)."""
    try:
        index = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # a truncated pickle fails in many ways; all mean damage
        raise InvalidArgument(
            f"checkpoint {path.name} is damaged: its shard index does not read ({_cause(error)})"
        ) from None
    if not isinstance(index, Metadata):
        raise InvalidArgument(f"checkpoint {path.name} is damaged: its shard index is no index")
    return index


def _group_layouts(path: Path, index: Metadata, saved: dict[str, Any]) -> dict[str, Layout]:
    """Each group's tensors as ``load_state`` allocates them, checked against the index.

    The parameters' shapes come from the index (a session takes them from its model); the
    optimizer's and the loss hook's from ``session.json`` (as ``load_state`` allocates them),
    and pending gradients are shaped like their parameters. Both files must name the same
    tensors: a checkpoint that verifies must also load.
    """
    indexed: dict[str, Layout] = {group: {} for group in DIGESTED_GROUPS}
    for key, entry in index.state_dict_metadata.items():
        group, _, name = key.partition(".")
        if group not in indexed or not isinstance(entry, TensorStorageMetadata):
            raise InvalidArgument(f"checkpoint {path.name}: its shard index holds {key!r}")
        indexed[group][name] = (list(entry.size), entry.properties.dtype)
    parameters = indexed[MODEL_KEY]
    strays = sorted(set(saved[GRADIENTS_KEY]) - set(parameters))
    if strays:
        raise InvalidArgument(
            f"checkpoint {path.name} is damaged: it holds gradients of no parameter ({strays[0]})"
        )
    layouts = {
        MODEL_KEY: parameters,
        OPTIMIZER_KEY: saved[OPTIMIZER_KEY],
        GRADIENTS_KEY: {name: parameters[name] for name in saved[GRADIENTS_KEY]},
        LOSS_HOOK_KEY: saved[LOSS_HOOK_KEY],
    }
    for group, layout in layouts.items():
        names = set(layout) | set(indexed[group])
        differ = sorted(n for n in names if layout.get(n) != indexed[group].get(n))
        if differ:
            raise InvalidArgument(
                f"checkpoint {path.name} is damaged: its {SESSION_FILE} and shard index "
                f"disagree about {group} tensor(s) {', '.join(differ[:3])}"
            )
    return layouts


class _IndexedReader(dcp.FileSystemReader):
    """A reader that reads the index once for the many loads of one verification."""

    def __init__(self, path: Path, index: Metadata) -> None:
        super().__init__(path)
        self.checkpoint, self.index = path.name, index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.index


def stored_parameters(path: Path) -> StoredGroup:
    """Sharded checkpoint ``path``'s parameters by name, each read whole when asked for, in this
    process and without a process group (a rank of a group may call it too: it reads alone).
    Their shapes and dtypes come from the shard index, before any is read. ``InvalidArgument``
    names a checkpoint whose index or tensors do not read."""
    index = _read_index(path)
    layout: Layout = {}
    for key, entry in index.state_dict_metadata.items():
        group, _, name = key.partition(".")
        if group == MODEL_KEY and isinstance(entry, TensorStorageMetadata):
            layout[name] = (list(entry.size), entry.properties.dtype)
    return StoredGroup(_IndexedReader(path, index), MODEL_KEY, layout)


class StoredGroup(Mapping[str, torch.Tensor]):
    """One group's tensors, each read whole from every rank's shards when asked for."""

    def __init__(self, reader: _IndexedReader, group: str, layout: Layout) -> None:
        self._reader, self._group, self._layout = reader, group, layout

    def placeholders(self) -> dict[str, torch.Tensor]:
        """Each tensor's shape and dtype as a tensor on the meta device (no data, nothing read):
        what a caller checks names, shapes and dtypes against before it reads any."""
        return {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, (shape, dtype) in self._layout.items()
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, dtype = self._layout[name]
        state = {self._group: {name: torch.zeros(shape, dtype=dtype)}}
        try:
            # dcp.load warns on every call that it reads in one process: that is the point here.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=self._reader, no_dist=True)
        except (Exception, CheckpointException) as error:  # CheckpointException: not Exception
            raise InvalidArgument(
                f"checkpoint {self._reader.checkpoint} is damaged: {self._group} tensor {name} "
                f"does not read ({_cause(error)})"
            ) from None
        return state[self._group][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout)

    def __len__(self) -> int:
        return len(self._layout)


def _cause(error: BaseException) -> str:
    """What failed, without DCP's wrapping (which carries each rank's traceback), and naming a
    file by its name in the checkpoint, never the server's path to it: clients read these."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    if isinstance(error, OSError) and error.filename is not None:
        return f"{type(error).__name__}: {error.strerror}: {Path(error.filename).name}"
    return f"{type(error).__name__}: {error}"
