"""The typed notes a Tinker save carries to the intake: what the front records once it applied.

Data, not code: a route fills one in when it decodes its call, the intake keeps it beside the
operation and hands it back to the front's one observer (``saves_applied.applied``) once the
operation applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwire.server.tinker.catalog import TinkerPath


@dataclass(frozen=True)
class SavedWeights:
    """``save_weights``: the checkpoint ``name`` of model ``path.model_id``, kept ``ttl_seconds``
    (None: until deleted); the model's request records before it are compacted."""

    path: TinkerPath
    name: str
    ttl_seconds: int | None
    seq_id: int


@dataclass(frozen=True)
class SamplerSnapshot:
    """``save_weights_for_sampler``: export ``export`` of run ``run_id`` holds a snapshot of
    model ``model_id``'s weights, named ``path`` (then a catalog entry) or for the new sampling
    session ``sampling_id`` (``inflight``: the model's inflight weights move to it)."""

    model_id: str
    run_id: str
    base_model: str
    export: str
    seq_id: int
    path: str  # "" for an unnamed snapshot
    name: str
    sampling_id: str
    ttl_seconds: int | None
    inflight: bool


@dataclass(frozen=True)
class ExternalWeights:
    """``save_weights_external``: export ``export`` offered as ``path``, kept ``ttl_seconds``,
    and only age-encrypted to ``recipients`` when any are given."""

    path: TinkerPath
    export: str
    ttl_seconds: int | None
    recipients: tuple[str, ...]
