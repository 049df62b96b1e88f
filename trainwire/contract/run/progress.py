"""The progress event a run hands to ``on_step`` callbacks after every microbatch.

The history records it carries are built in ``trainwire.contract.run.history``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    """One microbatch done: where the run stands."""

    microbatch: int  # the index just completed
    batch_count: int
    epoch: int
    step: int  # updates applied so far
    max_steps: int
    loss: float  # this microbatch's loss
    update: dict[str, Any] | None = None  # the update record, when one followed
    evaluation: dict[str, Any] | None = None  # the evaluation record, when one followed
    tokens: int = 0  # tokens in this microbatch, where known
    # Runner-specific notes. The controller sets "resumed" ({"microbatch": where the run
    # (re)started, "at_s": time.monotonic() then}) on the first microbatch after each start, so a
    # progress view measures its rate from there and never counts an outage as slow training.
    extra: dict[str, Any] = field(default_factory=dict)
