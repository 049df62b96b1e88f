"""Sampling the weights of a snapshot the trainer has since moved past.

``save_weights_for_sampler`` writes the trainable weights as an export of the run (an
ExportWeights through the journal: a restart finds it on disk, or writes it again with the same
bits when it replays the call). A sample on a snapshot that is no longer the live weights copies
the export's weights into the model, samples, and copies the live weights back, bit for bit, all
in one call on the executor: no operation ever sees the swap. What that costs: one copy of the
trainable weights in memory while it samples (the adapter under LoRA), reading the export, and the
exports on disk (the front keeps the newest few unnamed ones; see ``Samplers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trainwire.client.outcomes import Sample
from trainwire.client.tokens import TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.weights import plan_weights_load
from trainwire.server.errors import FailedPrecondition


@dataclass(frozen=True)
class SnapshotWeights:
    """Which weights a sample reads: the live ones, an export of the run, or the base model."""

    live: bool
    export: Path | None = None  # the snapshot's export (None with ``live`` False: the base)
    base_model: Path | None = None  # the base model's directory (full-weights base sampling)


@contextlib.contextmanager
def swapped_in(session: TrainingSession, source: Path) -> Iterator[None]:
    """The weights at ``source`` in the model for the block; the live bits back afterwards."""
    model = session.model
    load = plan_weights_load(model, source, session.config, session.base_fingerprint)
    touched = {id(p): p for p in model.parameters() if p.requires_grad}
    touched.update({id(live): live for live, _ in load.pairs})
    saved = [(p, p.detach().clone()) for p in touched.values()]
    try:
        with torch.no_grad():
            load.apply(model)
        yield
    finally:
        with torch.no_grad():
            for parameter, bits in saved:
                parameter.copy_(bits)


def weights_of(
    session: TrainingSession, weights: SnapshotWeights
) -> contextlib.AbstractContextManager:
    if weights.live:
        return contextlib.nullcontext()
    if weights.export is not None:
        if not weights.export.is_dir():
            raise FailedPrecondition(
                f"the snapshot {weights.export.name!r} of this sampling client was pruned (the "
                "server keeps the newest unnamed snapshots only); call "
                "save_weights_and_get_sampling_client() again, or save it under a name"
            )
        return swapped_in(session, weights.export)
    if session.config.lora is not None:
        return session.model.disable_adapter()  # the base model is the model without adapter
    assert weights.base_model is not None
    return swapped_in(session, weights.base_model)


def sample_from(
    session: TrainingSession,
    weights: SnapshotWeights,
    prompt: tuple[int, ...],
    *,
    prompt_logprobs: bool,
    **params: object,
) -> tuple[list[Sample], list[float] | None]:
    """Samples of ``prompt`` from ``weights`` and, when asked, the prompt tokens' logprobs (NaN
    for the first: it has no context), from ``forward``'s code, equal to a forward_backward's."""
    with weights_of(session, weights):
        samples = session.sample(prompt, **params)  # type: ignore[arg-type]
        if not prompt_logprobs:
            return samples, None
        if len(prompt) < 2:
            return samples, [float("nan")]
        scored = session.forward([TokenExample(prompt[:-1], prompt[1:])])
        return samples, [float("nan"), *scored.logprobs[0]]
