"""Samples of several LoRA sessions on one shared base, decoded as one batch.

Each session keeps a ``BatchDecoder`` of its own (its EOS, limits and tiles, its requests'
generators), so what a request draws, and when its rows end, is decided as in a batch of its
own session (``batch_decode``). Only the forwards are shared: at each step the tiles of every
session that hold the same positions and take the same input width (a prefill of one prompt
length, or one new token each) are stacked along the batch dimension, their KV caches too, and
run as one forward of the first tile's module tree, each tile's rows under its own session's
adapter (``row_blocks``); the caches are split back after it. So the base runs once over every
row of a stack. A row's attention, norms and adapter products see exactly the rows and cache
they see alone (each tile is its own row block); the base's linear layers and head multiply it
among the other tiles' rows, which gives it the same bits only where ``row_invariance`` says so
for blocks of its tile's positions (``stackable``). A stack holds only such tiles, and no more
positions than the probe covered; any other tile runs its own forward, as it does alone. Either
way each sample is bit for bit what its session gives it alone.

Scoring follows the same rule. Alone, each distinct sample's logprobs are one forward of its
example (prompt and tokens) on one row, then the head over that row's chunks. Here the samples
whose requests ended in a step are scored together: examples of one length, of every session,
run as one forward of the base, each row under its own session's adapter, where rows of that
many positions are ``row_invariance``'s; each sample's head then runs on its own row's hidden
states, as alone. A request's prompt scores (asked for) run alone, as in its session.

``sessions_problem`` and ``request_problem`` say, in words, why samples may not decode so (the
caller decodes them per session instead); ``sample_together`` decodes them. Output heads with
LoRA adapters (Tinker's ``train_unembed``) decode together too, beside heads without: each
tile's rows get the base's head and their own session's head adapter, if any
(``heads_by_row_block``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from trainwire.server.engine.loss.chunked_logprobs import final_hidden_states
from trainwire.server.engine.loss.token_batches import TokenBatch
from trainwire.server.engine.sampling import batch_decode
from trainwire.server.engine.sampling.batch_decode import BatchDecoder, DecodeJob, Drawn, Tile
from trainwire.server.engine.sampling.params import SamplingParams
from trainwire.server.engine.sampling.sample_weights import LIVE_WEIGHTS
from trainwire.server.engine.sampling.sampler import BatchedSample, SampleCall, Sampler
from trainwire.server.engine.session.session import TrainingSession
from trainwire.server.engine.together.compatibility import adapters_problem
from trainwire.server.engine.together.row_blocks import (
    adapters_by_row_block,
    heads_by_row_block,
)
from trainwire.server.engine.together.row_invariance import RowInvariance
from trainwire.server.errors import FailedPrecondition

SessionSample = tuple[TrainingSession, BatchedSample]
_Job = tuple[BatchDecoder, DecodeJob]


def sessions_problem(sessions: Sequence[TrainingSession]) -> str | None:
    """Why these sessions' samples cannot decode in one batch of their live weights, or None."""
    for index, session in enumerate(sessions):
        if session.shards is not None:
            return f"session {index} is sharded: every rank must make each of its decode calls"
        if not session.sampler.batches:
            return f"session {index}'s sampler decodes each request alone"
    return adapters_problem(sessions)


def request_problem(
    session: TrainingSession,
    prompt_length: int,
    params: SamplingParams,
    invariance: RowInvariance,
) -> str | None:
    """Why a request's tiles cannot stack with other tiles bit for bit, or None: its prefill
    takes its tile rows times its prompt's positions, each step after it (and the head, which
    reads one position a row) its tile rows."""
    sampler = session.sampler
    rows = batch_decode.tile_size(
        params,
        prompt_length,
        sampler.limits.max_sample_positions,
        sampler.decoding_tile_rows(session.device),
    )
    return invariance.problem([rows * prompt_length, rows])


def sample_together(
    requests: Sequence[SessionSample],
    join: Callable[[], list[SessionSample]],
    invariance: RowInvariance,
) -> None:
    """Decode ``requests`` (and those ``join`` hands over between steps), each under its
    session's live weights, as one batch; each is answered as ``sample_many`` answers it alone.

    ``sessions_problem`` of the sessions of ``requests`` must be None (FailedPrecondition, before
    anything runs, otherwise); a session joining later that would make it not None has its
    request refused with why, alone. A session is held (``TrainingSession.reading``) from its
    first request to the end of the batch. Only the engine's thread holds several sessions at
    once, so no lock order is needed among them.
    """
    sessions = list({id(session): session for session, _ in requests}.values())
    problem = sessions_problem(sessions)
    if problem is not None:
        raise FailedPrecondition(f"these samples cannot decode together: {problem}")
    with contextlib.ExitStack() as held:
        decoders: dict[TrainingSession, BatchDecoder] = {}

        def jobs(pairs: Iterable[SessionSample]) -> list[_Job]:
            out = []
            for session, request in pairs:
                if session not in decoders and not _hold(session, request, sessions, held):
                    continue
                sampler, model = session.sampler, session.model
                if session not in decoders:
                    decoders[session] = sampler.decoder(model)
                for call in sampler.calls(model, [request]):
                    drawn = functools.partial(stacked.drawn, sampler, model, call)
                    out.append((decoders[session], sampler.decode_job(model, call, drawn)))
            return out

        stacked = _Stacked(invariance)
        batch_decode.decode(stacked, jobs(requests), lambda: jobs(join()))


def _hold(
    session: TrainingSession,
    request: BatchedSample,
    sessions: list[TrainingSession],
    held: contextlib.ExitStack,
) -> bool:
    """Hold a session new to the batch for reading; a request of one that cannot join, or
    cannot be read, is refused alone."""
    problem = sessions_problem([sessions[0], session])
    if problem is not None:
        request.on_error(FailedPrecondition(f"this sample cannot decode together: {problem}"))
        return False
    try:
        held.enter_context(session.reading(LIVE_WEIGHTS))
    except Exception as error:  # its own session's failure: the others decode on
        request.on_error(error)
        return False
    if session not in sessions:
        sessions.append(session)
    return True


class _Stacked:
    """The sessions' decoders stepped as one (``batch_decode.Decoder``): a job is its
    session's decoder and its ``DecodeJob``."""

    def __init__(self, invariance: RowInvariance) -> None:
        self.invariance = invariance
        self.decoders: dict[BatchDecoder, None] = {}  # in the order they came
        self.ended: list[_Ended] = []  # requests whose rows all ended this step

    def drawn(
        self, sampler: Sampler, model: torch.nn.Module, call: SampleCall, drawn: Drawn
    ) -> None:
        """A request's rows have all ended: scored and answered after the step."""
        self.ended.append(_Ended(sampler, model, call, drawn))

    @property
    def busy(self) -> bool:
        return any(decoder.busy for decoder in self.decoders)

    def fits(self, job: _Job) -> bool:
        """Within the joining request's own KV bound, counting every session's tiles."""
        decoder, decode_job = job
        elsewhere = sum(other.held() for other in self.decoders if other is not decoder)
        return decoder.fits(decode_job, elsewhere)

    def add(self, job: _Job) -> None:
        decoder, decode_job = job
        self.decoders[decoder] = None
        decoder.add(decode_job)

    def step(self) -> None:
        for decoder in self.decoders:
            decoder.drop_cancelled()
        tiles = [(decoder, tile) for decoder in self.decoders for tile in decoder.tiles]
        logits: dict[Tile, torch.Tensor] = {}
        for stack in self._stacks(tiles):
            logits.update(_forward(stack))
        for decoder in self.decoders:
            decoder.finish_step({tile: logits[tile] for tile in decoder.tiles})
        ended, self.ended = self.ended, []
        _answer(ended, self.invariance)

    def _stacks(
        self, tiles: list[tuple[BatchDecoder, Tile]]
    ) -> list[list[tuple[BatchDecoder, Tile]]]:
        """Tiles of one length and input width, each ``stackable``, in stacks of at most the
        positions (and head rows) the probe covered; every other tile a stack of its own."""
        stacks: list[list[tuple[BatchDecoder, Tile]]] = []
        open_stacks: dict[tuple[int, int], list[tuple[BatchDecoder, Tile]]] = {}
        for decoder, tile in tiles:
            if not self.stackable(tile):
                stacks.append([(decoder, tile)])
                continue
            key = (tile.length, tile.inputs.shape[1])
            stack = open_stacks.get(key)
            if stack is None or not self._room(stack, tile):
                stack = open_stacks[key] = []
                stacks.append(stack)
            stack.append((decoder, tile))
        return stacks

    def stackable(self, tile: Tile) -> bool:
        """Whether the base gives this tile's rows the same bits among others' (its positions
        this step, and the head's one row a slot), and its cache can be stacked."""
        positions = tile.size * tile.inputs.shape[1]
        stackable_cache = not tile.length or hasattr(tile.cache, "layers")
        return stackable_cache and self.invariance.problem([positions, tile.size]) is None

    def _room(self, stack: list[tuple[BatchDecoder, Tile]], tile: Tile) -> bool:
        positions = sum(t.size * t.inputs.shape[1] for _, t in stack)
        rows = sum(t.size for _, t in stack)
        positions += tile.size * tile.inputs.shape[1]
        rows += tile.size
        return positions <= self.invariance.max_rows and rows <= self.invariance.head_rows


def _forward(stack: list[tuple[BatchDecoder, Tile]]) -> dict[Tile, torch.Tensor]:
    """Each tile's last logits from one forward over the stack (its own, for a stack of one);
    each tile's cache then holds its own rows' positions, as after its forward alone."""
    leader, first = stack[0]
    if len(stack) == 1:
        return {first: leader.forward(leader.model, first.inputs, first.cache)}
    tiles = [tile for _, tile in stack]
    sizes = [tile.size for tile in tiles]
    cache = batch_decode.cache_of(
        [
            (torch.cat([t.cache.layers[i].keys for t in tiles]),
             torch.cat([t.cache.layers[i].values for t in tiles]))
            for i in range(len(first.cache.layers) if first.length else 0)
        ]
    )  # fmt: skip
    inputs = torch.cat([tile.inputs for tile in tiles])
    models = [decoder.model for decoder, _ in stack]
    with adapters_by_row_block(models, sizes), heads_by_row_block(models, sizes):
        last = leader.forward(leader.model, inputs, cache)
    layers = [(layer.keys.split(sizes), layer.values.split(sizes)) for layer in cache.layers]
    for index, tile in enumerate(tiles):
        tile.cache = batch_decode.cache_of(
            [(keys[index], values[index]) for keys, values in layers]
        )
    return dict(zip(tiles, last.split(sizes), strict=True))


@dataclass(frozen=True)
class _Ended:
    sampler: Sampler
    model: torch.nn.Module
    call: SampleCall
    drawn: Drawn


def _answer(ended: list[_Ended], invariance: RowInvariance) -> None:
    """Each ended request's samples scored and answered (``Sampler.answer``). Alone, each
    distinct sample's score is one forward of its example (prompt and tokens) on one row; here
    the examples of one length (the positions of each ``stackable`` as a decode tile's are),
    of every request, run as one forward of the base, each row under its own session's adapter,
    and each sample's head runs on its own row's hidden states, as alone."""
    hidden: list[dict[tuple[int, ...], torch.Tensor]] = [{} for _ in ended]
    by_width: dict[int, list[tuple[int, tuple[int, ...], TokenBatch]]] = {}
    for index, request in enumerate(ended):
        prompt, device = request.call.prompt, next(request.model.parameters()).device
        for tokens in {tuple(tokens): None for tokens, _ in request.drawn}:
            example = request.sampler.scoring_batch(prompt, tokens, device)
            width = example.input_ids.shape[1]
            if invariance.problem([width]) is None:
                by_width.setdefault(width, []).append((index, tokens, example))
    for width, examples in by_width.items():
        per_stack = max(1, invariance.max_rows // width)
        for start in range(0, len(examples), per_stack):
            stack = examples[start : start + per_stack]
            if len(stack) < 2:
                continue  # its own forward, in ``answer``
            models = [ended[index].model for index, _, _ in stack]
            input_ids = torch.cat([example.input_ids for _, _, example in stack])
            mask = torch.cat([example.attention_mask for _, _, example in stack])
            with adapters_by_row_block(models, [1] * len(stack)):
                states, _ = final_hidden_states(models[0], input_ids, mask)
            for (index, tokens, _), row in zip(stack, states.split(1), strict=True):
                hidden[index][tokens] = row
    for request, own in zip(ended, hidden, strict=True):
        request.sampler.answer(request.model, request.call, request.drawn, own)
