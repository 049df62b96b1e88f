"""The typed requests of the operation table (``operations``): what a transport decodes into.

Plain frozen dataclasses, one per kind of request, named after the RPC they come from; a field
added here is read by its operation's payload and apply, and decoded by each transport's codec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from trainwire.contract import outcomes
from trainwire.contract.tokens import DEFAULT_LOSS, Examples

# The kinds of the two operations recovery reads back from the journal (``operations`` names
# every kind: a kind is what its RPC is called).
SAVE_STATE_KIND = "SaveState"
EXPORT_WEIGHTS_KIND = "ExportWeights"


@dataclass(frozen=True)
class ForwardRequest:
    """A batch scored without gradients: text examples, or token examples with a loss."""

    examples: Examples
    loss_fn: str = DEFAULT_LOSS
    loss_fn_config: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardBackwardRequest(ForwardRequest):
    """A microbatch whose gradients accumulate (the same fields as a forward)."""


@dataclass(frozen=True)
class OptimStepRequest:
    """One update: ``learning_rate`` replaces the schedule's for it, and each AdamW setting
    given replaces the run's for it only (``max_grad_norm=0``: no clipping); ``sum_microbatches``
    adds the microbatches' gradients instead of averaging them (Tinker's semantics)."""

    learning_rate: float | None = None
    sum_microbatches: bool = False
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None


@dataclass(frozen=True)
class CheckpointRequest:
    """SaveState or LoadState of the run's checkpoint ``name``; a LoadState may name another
    run's (``run_id``: a new run continuing one saved by a run that has closed)."""

    name: str
    run_id: str = ""


@dataclass(frozen=True)
class LoadWeightsRequest:
    """Weights from ``source``; a checkpoint or export of another run with ``run_id``."""

    source: outcomes.WeightsSource
    run_id: str = ""


@dataclass(frozen=True)
class ExportWeightsRequest:
    """Write export ``name``: the live weights, or ``checkpoint``'s when one is named.

    ``written_once`` (what the export is to its caller: named sampler weights, whose sampling
    clients keep reading them) makes a name in use (its folder there, written by a live journal
    entry) a refusal at the export's turn, named so, instead of new weights under readers of the
    old ones; a replayed key is answered from the journal before that check, as every keyed
    call is, and a folder a crash left before its entry committed is written again."""

    name: str
    checkpoint: str = ""
    written_once: str = ""


@dataclass(frozen=True)
class SampleRequest:
    """Continuations of ``prompt_tokens`` (the engine's ``sample`` arguments).

    The weights sampled are the live ones, or those of the run's export ``export`` (a snapshot
    the trainer may have moved past), or with ``base_model`` the model before any training.
    ``live_at`` (with ``export``): the run's ``weights_version`` when the export was written;
    while the live weights are still that version the sample reads them instead (the same
    bits, no swap), and once they moved on, ``export_gone`` (when given) is why the export can
    no longer be read (FailedPrecondition). Decided at the sample's turn (``resolve_snapshot``),
    so it sees every update and load queued before it.
    ``prompt_logprobs`` also scores the prompt under the same weights, in the same operation;
    ``topk_prompt_logprobs`` reports the k most likely ids of each prompt position, both for
    the last ``prompt_logprobs_last_n`` tokens only when given, and ``target_prompt_logprobs``
    the logprobs of the ids it names, one row a prompt position after the first (-1: none).
    ``topk_sample_logprobs`` reports the k most likely ids of each sampled position.
    """

    prompt_tokens: Sequence[int]
    max_tokens: int
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_tokens: Sequence[int] = ()
    seed: int = 0
    stop_strings: Sequence[str] = ()
    export: str = ""
    export_run: str = ""  # the run that wrote ``export``, when not the open one
    base_model: bool = False
    live_at: int | None = None
    export_gone: str = ""
    prompt_logprobs: bool = False
    topk_sample_logprobs: int = 0
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: Sequence[Sequence[int]] | None = None
    # Reported beside the samples, deciding none of their draws: the top k of sampled positions
    # (``sample``'s own keyword) and what is asked about the prompt (``reads.prompt_scoring``).
    REPORTS: ClassVar[tuple[str, ...]] = (
        "topk_sample_logprobs",
        "prompt_logprobs",
        "topk_prompt_logprobs",
        "prompt_logprobs_last_n",
        "target_prompt_logprobs",
    )
    # Whether the caller gave up (a cancelled RPC): not part of what is asked, so never compared.
    cancelled: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def sampling_settings(self) -> dict[str, Any]:
        """The engine's ``sample`` keywords that decide the draws: every field but the prompt,
        the reports beside the samples (``REPORTS``), the weights' choice and the caller's
        liveness."""
        settings = {f.name: getattr(self, f.name) for f in fields(self)}
        weights = ("export", "export_run", "base_model", "live_at", "export_gone")
        for name in ("prompt_tokens", *weights, "cancelled"):
            del settings[name]
        for name in self.REPORTS:
            del settings[name]
        return settings


@dataclass(frozen=True)
class DiscardExportsRequest:
    """Remove the run's exports ``names`` (snapshots no sampler needs any more); a missing one
    is no error."""

    names: Sequence[str]


@dataclass(frozen=True)
class TokenizeRequest:
    texts: Sequence[str]
    add_special_tokens: bool = True


@dataclass(frozen=True)
class DetokenizeRequest:
    token_lists: Sequence[Sequence[int]]
