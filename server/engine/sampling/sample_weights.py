"""Which weights a sample reads: the live ones, an export of the run, or the base model.

``TrainingSession.sample`` and ``prompt_logprobs`` take one of these (or what ``SampleWeights.of``
turns into one); ``TrainingSession.sample`` swaps the selected weights in and back inside the
session's guard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainwire.server.errors import InvalidArgument


@dataclass(frozen=True)
class SampleWeights:
    """Which weights ``TrainingSession.sample`` and ``prompt_logprobs`` read.

    ``SampleWeights()`` (``LIVE_WEIGHTS``): the live weights, as trained so far. ``export``: a
    weights directory of this run (what ``export_weights`` wrote; a session checkpoint loads
    too), read and checked as ``load_weights`` would before any live tensor changes.
    ``base_model=True`` (``BASE_MODEL``): the model the run started from, before any training:
    under LoRA the model with its adapter disabled (the base weights the adapter trains on, as
    ``load_weights`` may have seeded them), in full the model directory the session loaded.

    The session passes ``SampleWeights.of(value)`` of what the caller gave: None (live), a path
    (an export), or one of these.
    """

    export: Path | None = None
    base_model: bool = False

    def __post_init__(self) -> None:
        if self.export is not None:
            if self.base_model:
                raise InvalidArgument("weights: an export or the base model, not both")
            object.__setattr__(self, "export", Path(self.export))

    @property
    def live(self) -> bool:
        return self.export is None and not self.base_model

    @classmethod
    def of(cls, weights: SampleWeights | str | os.PathLike[str] | None) -> SampleWeights:
        """The selection ``weights`` names: None is the live weights, a path an export."""
        if weights is None:
            return LIVE_WEIGHTS
        if isinstance(weights, SampleWeights):
            return weights
        if isinstance(weights, (str, os.PathLike)) and str(weights):
            return cls(export=Path(weights))
        raise InvalidArgument(
            "weights must be None (the live weights), the path of an export of this run, or "
            f"BASE_MODEL; got {weights!r}"
        )


LIVE_WEIGHTS = SampleWeights()
BASE_MODEL = SampleWeights(base_model=True)
