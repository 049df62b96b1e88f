"""The service's domain types: requests' operation specs and every result, as plain dataclasses.

Both sides share these: the session host returns them, the journal records them, the servicer
encodes them (``trainwire.contract.codec``) and ``SessionClient`` decodes them back into the same
classes. Neither protobuf nor grpc is imported here.
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field
from pathlib import Path

# Lifecycle names, as SessionInfo.state spells them.
IDLE, RESTORING, OPEN, CLOSED, FAILED = "idle", "restoring", "open", "closed", "failed"

FORMAT_FULL, FORMAT_ADAPTER = "full", "adapter"


# -- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OperationSpec:
    """What makes a state-changing request exactly-once and ordered (``Operation`` on the wire)."""

    key: str
    expected_position: int | None = None
    include_digest: bool = False


@dataclass(frozen=True)
class WeightsSource:
    """Where ``load_weights`` reads from: ``kind`` is checkpoint, export or model_path."""

    kind: str
    value: str

    @classmethod
    def parse(cls, source: str | WeightsSource) -> WeightsSource:
        """``checkpoint:NAME``, ``export:NAME``, ``model:PATH`` or a bare model path."""
        if isinstance(source, WeightsSource):
            return source
        kind, sep, value = source.partition(":")
        if sep and kind in ("checkpoint", "export"):
            return cls(kind, value)
        if sep and kind == "model":
            return cls("model_path", value)
        return cls("model_path", source)


WEIGHTS_SOURCE_KINDS = ("checkpoint", "export", "model_path")


# -- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SessionInfo:
    """Where the server's session stands. Equal ``state_digest``s mean equal continuation state."""

    run_id: str = ""
    config_fingerprint: str = ""
    step: int = 0
    last_operation_key: str = ""
    state_digest: str = ""
    position: int = 0  # state-changing operations applied: the next expected_position
    restored_checkpoint: str = ""
    device: str = ""
    state: str = IDLE
    pending_microbatches: int = 0
    max_steps: int = 0  # 0: none given
    plan_fingerprint: str = ""
    damaged_checkpoints: tuple[str, ...] = ()  # passed over by the last restart's recovery


@dataclass(frozen=True)
class OpenOutcome(SessionInfo):
    """The session after ``open``; ``created`` is True when this call created it."""

    created: bool = False

    @classmethod
    def from_info(cls, info: SessionInfo, *, created: bool) -> OpenOutcome:
        return cls(**dataclasses.asdict(info), created=created)


@dataclass(frozen=True)
class Prediction:
    label: str
    scores: tuple[float, ...]


@dataclass(frozen=True)
class ForwardOutcome:
    """A forward: the batch loss, predictions (text classification), and for token batches
    every target's logprob (one tuple per example) and the loss's ``name:reduction`` metrics."""

    loss: float
    predictions: tuple[Prediction, ...] = ()
    logprobs: tuple[tuple[float, ...], ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OperationOutcome:
    """An applied (or replayed) state-changing operation: where it left the session."""

    operation_key: str
    position: int
    replayed: bool = False
    state_digest: str = ""  # filled on request (include_digest), and always by save_state


@dataclass(frozen=True)
class ForwardBackwardOutcome(OperationOutcome):
    """A microbatch applied: its loss and token count; for token batches also each target's
    logprob before the update (one tuple per example) and the loss's metrics."""

    loss: float = 0.0
    token_count: int = 0  # non-padding tokens in the microbatch, for throughput
    logprobs: tuple[tuple[float, ...], ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStepOutcome(OperationOutcome):
    step: int = 0
    learning_rate: float = 0.0
    grad_norm: float = 0.0


@dataclass(frozen=True)
class CheckpointOutcome(OperationOutcome):
    """A checkpoint saved or loaded: its name and the optimizer updates it holds."""

    name: str = ""
    step: int = 0


@dataclass(frozen=True)
class ExportedFile:
    path: str  # relative to the export directory, '/'-separated
    size_bytes: int
    sha256: str  # lower-case hex


@dataclass(frozen=True)
class ExportOutcome(OperationOutcome):
    """An export written on the server. ``directory`` is where its files are on this side: the
    download directory on a client (None without a download), the export itself on the server."""

    name: str = ""
    format: str = ""
    files: tuple[ExportedFile, ...] = ()
    directory: Path | None = field(default=None, compare=False)


@dataclass(frozen=True)
class TopLogprobs:
    """The ``k`` most likely ids of consecutive positions, best first, with their logprobs, held
    flat and compact (a long sample's top 20 are millions of values): position ``i``'s ids are
    ``ids[i * k : (i + 1) * k]`` (int32) and their logprobs the same slice of ``logprobs``
    (float32, each value exact)."""

    k: int
    ids: array = field(default_factory=lambda: array("i"))
    logprobs: array = field(default_factory=lambda: array("f"))

    def __len__(self) -> int:
        return len(self.ids) // self.k if self.k else 0

    def rows(self) -> list[list[tuple[int, float]]]:
        """Each position's ``[(id, logprob), ...]``, as the SDK's lists read."""
        k = self.k
        return [
            list(
                zip(self.ids[i * k : (i + 1) * k], self.logprobs[i * k : (i + 1) * k], strict=True)
            )
            for i in range(len(self))
        ]


@dataclass(frozen=True)
class Sample:
    """One sampled continuation: its new tokens (a stop token kept), the model's own logprob of
    each at temperature 1, and why it ended: ``"stop"`` (a stop token or EOS) or ``"length"``."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: str
    # The top k of each sampled position, when the request asked for them: one row a token.
    topk_logprobs: TopLogprobs | None = None


@dataclass(frozen=True)
class PromptLogprobs:
    """What a sample request asked about its prompt, under the weights it sampled. Position
    ``i`` is prompt token ``i`` given the tokens before it; position 0 has nothing before it and
    is never scored. Each value is bit for bit what ``forward`` gives for that id there.

    ``first``: the first position whose logprob and top k are reported (1, or where the last n
    the request limited them to begin). ``logprobs``: one a prompt token, NaN before ``first``;
    None when not asked. ``topk``: the top k of each position from ``first`` on; None when not
    asked. ``targets``: one row a position after the
    first (``[len(prompt) - 1, K]``), the logprob of each id the request named there, None where
    it named none (-1); None when not asked.
    """

    first: int = 1
    logprobs: tuple[float, ...] | None = None
    topk: TopLogprobs | None = None
    targets: tuple[tuple[float | None, ...], ...] | None = None
