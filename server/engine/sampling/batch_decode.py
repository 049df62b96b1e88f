"""One KV-cache decode for many sample requests at once, each row's tokens its own request's.

Requests that wait together decode together: one forward per step for all their rows instead of
a decode loop per request. What a request gets must not depend on what decoded beside it, and
two things would make it so:

- Shapes. A matmul's kernel (and so the order of its sums) depends on how many rows it
  multiplies: on CPU fp32 a row's logits alone differ in the last bits from the same row among
  others, and left padding a shorter prompt changes them too. So rows decode in *tiles* of a
  fixed row count, every forward of a tile has that many rows (free slots are filled with a copy
  of a live row and their output thrown away), and a tile only holds rows of one current length:
  no padding, and a row's forward has the same shape alone and in any company. The tile size is
  a function of the request alone (``tile_rows_for``), so rows only share tiles with rows of the
  same size. A row's bits do not depend on its slot in the tile nor on the other rows' values
  (the same kernel runs each row's sums in the same order), which ``tests/test_sample_batching``
  holds on CPU; a device whose kernels break that (docs/BENCHMARKS.md) decodes requests alone.
- Draws. Each request draws from its own ``torch.Generator``, once per step, for all its rows,
  with ``draws.next_tokens``; a row that has ended keeps a place in that draw (filled
  with a live row's logits), because the draw's noise is laid out per row: the other rows'
  tokens are then those of a decode where the ended row had stayed.

On a sharded session every rank runs this decode on the FSDP model, and every forward gathers
weights from every rank: the ranks must run the same forwards, which a row's tokens decide (when
it ends, what is repacked). Their logits may differ in the last bits on a device (each rank's
kernels are its own), so a draw could differ; ``agree`` makes each draw rank 0's on every rank
(a broadcast of the drawn token ids, one small tensor a request a step) before anything reads it.

Rows leave when they end; tiles of one length whose live rows fit in fewer tiles are repacked,
and a tile with no live row is dropped. A request that arrives while others decode joins at the
next step (``add``) if the KV cache's bound allows, as its own tiles (its length differs).

A step is ``drop_cancelled``, one ``forward`` per tile, then ``finish_step`` (draws, ends,
repacking): so the decoders of several sessions can step as one, their tiles' forwards run
together (``together.sampling``), each decoder keeping its own draws.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from transformers import DynamicCache

from trainwire.server.engine.sampling.draws import LENGTH, STOP, next_tokens
from trainwire.server.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from trainwire.server.engine.sampling.stop_strings import StopStringWatch

# Rows of every decode forward (see tile_rows_for). On CPU a forward costs about its rows (8 keeps
# padding cheap, bench/sampling_concurrent.py); on an accelerator a step costs about the same for
# 4 rows as for 64, so fewer, fuller forwards win (32: not measured here, no GPU was at hand).
CPU_TILE_ROWS = 8
ACCELERATOR_TILE_ROWS = 32


CANCELLED = "cancelled"  # a row's end when its caller gave up (never in an answer)
OWN_ROWS = 0  # a tile_rows meaning: each request's tiles are its own sample count (no padding)


def tile_rows_on(device: torch.device) -> int:
    """The tile size for ``device``: one per device, so rows of one device always share tiles
    of one shape."""
    return CPU_TILE_ROWS if device.type == "cpu" else ACCELERATOR_TILE_ROWS


Drawn = list[tuple[list[int], str]]  # each sample's new tokens and stop reason


@dataclass(frozen=True)
class Cancel:
    """How a decode hears that its caller gave up: ``asked()`` is polled before every step, and
    once it is true the request's rows leave and ``answer()`` tells the caller, instead of
    decoding to ``max_tokens`` for nobody."""

    asked: Callable[[], bool]
    answer: Callable[[], None]


@dataclass(eq=False)
class DecodeJob:
    """One request's decode; ``on_done`` gets its samples as soon as its last row ends."""

    prompt: tuple[int, ...]
    params: SamplingParams
    watch: StopStringWatch | None
    on_done: Callable[[Drawn], None]
    cancel: Cancel | None = None


def tile_rows_for(rows: int, positions: int, max_positions: int, largest: int) -> int:
    """The tile size of a request of ``rows`` samples of ``positions`` positions each: the
    largest power of two up to ``largest`` whose padded tiles stay within ``max_positions``
    (the bound each request is checked against), so padding never lets a request hold more KV
    cache than the limit; 1 (no padding) always fits a request that passed its check."""
    size = max(1, largest)
    while size > 1 and math.ceil(rows / size) * size * positions > max_positions:
        size //= 2
    return size


def tile_size(
    params: SamplingParams, prompt_length: int, max_positions: int, tile_rows: int
) -> int:
    """The rows of every forward of a request's tiles, in a decoder of ``tile_rows`` under
    ``max_positions``: its prefill is ``tile_size`` rows of ``prompt_length`` positions, each
    step after it ``tile_size`` rows of one."""
    if tile_rows == OWN_ROWS:
        return params.num_samples
    positions = prompt_length + params.max_tokens
    return tile_rows_for(params.num_samples, positions, max_positions, tile_rows)


@dataclass(eq=False)
class _Request:
    """A job being decoded: its generator, its rows' tokens and ends."""

    job: DecodeJob
    generator: torch.Generator
    stops: frozenset[int]
    tile_rows: int
    positions: int  # prompt + max_tokens: the longest any of its rows grows
    sampled: list[list[int]]
    reasons: list[str | None]

    @property
    def ended(self) -> bool:
        return all(reason is not None for reason in self.reasons)

    def drawn(self) -> Drawn:
        return [(t, r or LENGTH) for t, r in zip(self.sampled, self.reasons, strict=True)]


@dataclass(frozen=True)
class _Row:
    """One sample's row; equal (and hashed) by its request's identity and its index."""

    request: _Request
    index: int  # which of its request's samples

    @property
    def live(self) -> bool:
        return self.request.reasons[self.index] is None


@dataclass(eq=False)
class Tile:
    """Rows of one length in one cache, a fixed number of slots (None: padding, computed and
    thrown away); ``inputs`` is what the next forward reads (the prompt before the first, then
    each slot's newest token)."""

    slots: list[_Row | None]
    inputs: torch.Tensor  # [len(slots), n]
    cache: DynamicCache = field(default_factory=DynamicCache)
    length: int = 0  # positions in the cache

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def rows(self) -> list[_Row]:
        return [row for row in self.slots if row is not None]

    def bound(self) -> int:
        """The most KV positions this tile may come to hold."""
        return self.size * max(row.request.positions for row in self.rows)


class BatchDecoder:
    """Decodes every job added to it, a step at a time, under ``max_positions``' KV bound."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_ids: Sequence[int],
        device: torch.device,
        max_positions: int,
        tile_rows: int | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        # The group's draw from this rank's (``ShardGroup.from_rank_zero``); None: one process,
        # whose draws are its own, untouched.
        self.agree = agree
        self.eos_ids = frozenset(eos_ids)
        self.device = device
        self.max_positions = max_positions
        self.tile_rows = tile_rows_on(device) if tile_rows is None else tile_rows
        self.tiles: list[Tile] = []
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        accepted = inspect.signature(base.forward).parameters
        self._cache_keyword = "cache" if "cache" in accepted else "past_key_values"
        self._keep_last = "logits_to_keep" in accepted

    @property
    def busy(self) -> bool:
        return bool(self.tiles)

    def held(self) -> int:
        """The most KV positions the tiles now decoding may come to hold."""
        return sum(tile.bound() for tile in self.tiles)

    def fits(self, job: DecodeJob, elsewhere: int = 0) -> bool:
        """Whether ``job`` may join now: every tile's bound, its own and ``elsewhere`` (what
        decoders beside this one hold, ``together.sampling``) stay within the limit (a job
        always fits when nothing decodes, having passed its own check)."""
        request = self._request(job)
        rows = request.job.params.num_samples
        own = math.ceil(rows / request.tile_rows) * request.tile_rows * request.positions
        busy = self.tiles or elsewhere
        return not busy or self.held() + elsewhere + own <= self.max_positions

    def add(self, job: DecodeJob) -> None:
        """Start ``job``'s rows at the next step: full tiles of their own, and the rest in the
        free slots of a tile of the same size and prompt length that starts then too (so
        requests arriving together share tiles), else in one more tile. Never more tiles than
        its own would take, so ``fits``' bound holds."""
        request = self._request(job)
        rows = [_Row(request, i) for i in range(job.params.num_samples)]
        prompt = torch.tensor(list(job.prompt), dtype=torch.long, device=self.device)
        size = request.tile_rows
        full = len(rows) - len(rows) % size
        for start in range(0, full, size):
            self.tiles.append(Tile([*rows[start : start + size]], prompt.expand(size, -1).clone()))
        rest = rows[full:]
        if not rest:
            return
        shared = next((t for t in self.tiles if _takes(t, size, len(prompt), len(rest))), None)
        if shared is None:
            shared = Tile([None] * size, prompt.expand(size, -1).clone())
            self.tiles.append(shared)
        for row in rest:
            slot = shared.slots.index(None)
            shared.slots[slot] = row
            shared.inputs[slot] = prompt

    def step(self) -> None:
        """One forward of every tile, one draw per request, then ends, leaving and repacking."""
        self.drop_cancelled()
        self.finish_step({t: self.forward(self.model, t.inputs, t.cache) for t in self.tiles})

    def forward(self, model: torch.nn.Module, inputs: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode forward of ``model`` over ``inputs`` (a tile's, or tiles' stacked) on
        ``cache``: each row's last logits, in fp32."""
        keywords: dict[str, Any] = {"use_cache": True, self._cache_keyword: cache}
        if self._keep_last:
            keywords["logits_to_keep"] = 1
        return model(input_ids=inputs, **keywords).logits[:, -1, :].float()

    def finish_step(self, logits: dict[Tile, torch.Tensor]) -> None:
        """After every tile's forward (``logits``: each tile's rows' last logits): the tiles'
        lengths advance, one draw per request, then ends, leaving and repacking."""
        rows: dict[_Row, torch.Tensor] = {}
        for tile, last in logits.items():
            tile.length += tile.inputs.shape[1]
            rows.update((row, last[slot]) for slot, row in enumerate(tile.slots) if row)
        for request in {row.request: None for row in rows}:
            self._draw(request, rows)
        for tile in self.tiles:
            tile.slots = [row if row is not None and row.live else None for row in tile.slots]
        self.tiles = [tile for tile in self.tiles if tile.rows]
        self._repack()
        for tile in self.tiles:
            first = tile.rows[0].request.sampled[tile.rows[0].index][-1]  # padding's token
            tokens = [first if row is None else row.request.sampled[row.index][-1]
                      for row in tile.slots]  # fmt: skip
            tile.inputs = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]

    def drop_cancelled(self) -> None:
        """Rows of requests whose caller gave up leave before the next forward. What the
        others draw does not depend on them (see the module's note), so nothing else changes.
        Never on a sharded session: there only rank 0 would know, and every rank must run the
        same forwards (``agree`` is set there, and the service passes no ``cancel``)."""
        requests = {row.request: None for tile in self.tiles for row in tile.rows}
        gone = [r for r in requests if r.job.cancel is not None and r.job.cancel.asked()]
        if not gone:
            return
        for request in gone:
            request.reasons = [reason or CANCELLED for reason in request.reasons]
        for tile in self.tiles:
            tile.slots = [row if row is not None and row.live else None for row in tile.slots]
        self.tiles = [tile for tile in self.tiles if tile.rows]
        self._repack()
        for request in gone:
            assert request.job.cancel is not None
            request.job.cancel.answer()

    def _request(self, job: DecodeJob) -> _Request:
        params = job.params
        positions = len(job.prompt) + params.max_tokens
        rows = params.num_samples
        return _Request(
            job,
            torch.Generator(device=self.device).manual_seed(params.seed),
            frozenset(params.stop_tokens) | self.eos_ids,
            tile_size(params, len(job.prompt), self.max_positions, self.tile_rows),
            positions,
            [[] for _ in range(rows)],
            [None] * rows,
        )

    def _draw(self, request: _Request, logits: dict[_Row, torch.Tensor]) -> None:
        """One draw for all the request's rows; an ended row's place holds a live row's logits
        (its token is thrown away), so the live rows draw as if it had stayed. One exception:
        ``draws._tempered`` picks its stable path when any row overflows at a near-zero
        temperature, and an ended row's logits do not count there."""
        params = request.job.params
        rows = [_Row(request, i) for i in range(params.num_samples)]
        present = [logits.get(row) for row in rows]
        filler = next(value for value in present if value is not None)
        stacked = torch.stack([filler if value is None else value for value in present])
        drawn = next_tokens(stacked, params, request.generator)
        chosen = (drawn if self.agree is None else self.agree(drawn)).tolist()
        watch = request.job.watch
        for index, token in enumerate(chosen):
            if request.reasons[index] is not None:
                continue
            tokens = request.sampled[index]
            tokens.append(token)
            if token in request.stops or (watch and watch.reached(tokens)):
                request.reasons[index] = STOP
            elif len(tokens) == params.max_tokens:
                request.reasons[index] = LENGTH
        if request.ended:
            request.job.on_done(request.drawn())

    def _repack(self) -> None:
        """Tiles of one size and length whose live rows fit in fewer tiles become fewer tiles:
        the rows' caches gathered, padding refilled from a live row's copy."""
        groups: dict[tuple[int, int], list[Tile]] = {}
        for tile in self.tiles:
            if tile.length:  # a tile not yet run has no cache to gather
                groups.setdefault((tile.size, tile.length), []).append(tile)
        for (size, _), tiles in groups.items():
            rows = sum(len(tile.rows) for tile in tiles)
            if math.ceil(rows / size) >= len(tiles) or not hasattr(tiles[0].cache, "layers"):
                continue
            packed = _gather(tiles, size, self.device)
            self.tiles = [tile for tile in self.tiles if tile not in tiles] + packed


def _takes(tile: Tile, size: int, prompt_length: int, rows: int) -> bool:
    """Whether ``rows`` new rows of that prompt length fit a tile that has not run yet."""
    fits = tile.size == size and tile.slots.count(None) >= rows
    return fits and not tile.length and tile.inputs.shape[1] == prompt_length


def _gather(tiles: list[Tile], size: int, device: torch.device) -> list[Tile]:
    """The live rows of ``tiles`` (one size, one length) in as few tiles as hold them."""
    rows = [row for tile in tiles for row in tile.rows]
    layers = len(tiles[0].cache.layers)
    keys, values = [], []
    for layer in range(layers):
        keys.append(torch.cat([_live(t, t.cache.layers[layer].keys, device) for t in tiles]))
        values.append(torch.cat([_live(t, t.cache.layers[layer].values, device) for t in tiles]))
    packed = []
    for start in range(0, len(rows), size):
        own: list[_Row | None] = [*rows[start : start + size]]
        index = list(range(start, start + len(own))) + [start] * (size - len(own))
        own += [None] * (size - len(own))
        chosen = torch.tensor(index, device=device)
        cache = cache_of([(keys[layer][chosen], values[layer][chosen]) for layer in range(layers)])
        packed.append(Tile(own, tiles[0].inputs, cache, tiles[0].length))
    return packed


def cache_of(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A KV cache holding each layer's ``(keys, values)`` (none: an empty cache)."""
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(layers):
        cache.update(keys, values, layer)
    return cache


def _live(tile: Tile, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The cache rows of ``tile``'s live rows, in slot order."""
    slots = [slot for slot, row in enumerate(tile.slots) if row is not None]
    return tensor[torch.tensor(slots, device=device)]


Job = TypeVar("Job")


class Decoder(Protocol[Job]):
    """What ``decode`` steps: a ``BatchDecoder``, or several stepped as one
    (``together.sampling``)."""

    @property
    def busy(self) -> bool: ...

    def fits(self, job: Job) -> bool: ...

    def add(self, job: Job) -> None: ...

    def step(self) -> None: ...


def decode(decoder: Decoder[Job], jobs: Sequence[Job], join: Callable[[], list[Job]]) -> None:
    """Decode ``jobs`` and whatever ``join`` hands over between steps until every row ended.

    ``join()`` returns jobs that arrived meanwhile; one that does not fit the KV bound now waits
    (kept first in line) for rows to end. Each job's ``on_done`` runs as it ends.
    """
    waiting: list[Job] = []
    for job in jobs:
        (decoder.add if decoder.fits(job) else waiting.append)(job)
    while decoder.busy or waiting:
        waiting += join()
        while waiting and decoder.fits(waiting[0]):
            decoder.add(waiting.pop(0))
        decoder.step()
