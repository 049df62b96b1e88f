"""The unkeyed operations of the table (``operations``): reads, and removing snapshot exports.

They change no continuation state, so they take no operation key and are never journaled; they
still run on the engine thread, behind every operation queued before them, so a read never sees
weights in the middle of an update and an export is never removed while a sample reads it.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract import outcomes
from trainwire.server.engine.sampling.params import PromptScoring
from trainwire.server.engine.sampling.sample_weights import BASE_MODEL, LIVE_WEIGHTS, SampleWeights
from trainwire.server.engine.session.results import ForwardResult, TokenOutput
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.service.active_run import ActiveRun, Applying
from trainwire.server.service.request_limits import check_texts, check_token_lists
from trainwire.server.service.requests import (
    DetokenizeRequest,
    DiscardExportsRequest,
    SampleRequest,
    TokenizeRequest,
)
from trainwire.server.service.state_dir import check_name, sibling_run


def token_fields(result: TokenOutput) -> tuple[tuple[tuple[float, ...], ...], dict[str, float]]:
    """A token batch's logprobs (a tuple per example) and metrics, as the outcomes hold them."""
    return tuple(tuple(row) for row in result.logprobs), dict(result.metrics)


def forward_outcome(_run: ActiveRun, result: ForwardResult | TokenOutput) -> Any:
    """A forward's outcome, from the engine's result (alone or in a shared pass)."""
    if isinstance(result, TokenOutput):
        return outcomes.ForwardOutcome(result.loss, (), *token_fields(result))
    return outcomes.ForwardOutcome(result.loss, tuple(result.predictions))


def check_tokenize(request: TokenizeRequest, _root: Path | None) -> None:
    check_texts(request.texts)


def check_detokenize(request: DetokenizeRequest, _root: Path | None) -> None:
    check_token_lists(request.token_lists)


@dataclass(frozen=True)
class SampleResult:
    """A sample request's samples, and what it asked about its prompt (None: nothing)."""

    samples: list[outcomes.Sample]
    prompt_logprobs: outcomes.PromptLogprobs | None = None


def prompt_scoring(request: SampleRequest) -> PromptScoring:
    """What ``request`` asks about its prompt, in the engine's terms (checked there, against
    the vocabulary and the session's limits)."""
    targets = request.target_prompt_logprobs
    return PromptScoring(
        logprobs=request.prompt_logprobs,
        top_k=request.topk_prompt_logprobs,
        last_n=request.prompt_logprobs_last_n,
        targets=None if targets is None else tuple(tuple(row) for row in targets),
    )


def check_sample(request: SampleRequest, _root: Path | None) -> None:
    """The export's name; the sampling settings are the engine's to check (it knows the
    vocabulary and the limits)."""
    if request.export_run:
        check_name(request.export_run, "run id")
        if not request.export:
            raise InvalidArgument("sample: export_run names the run of an export; name the export")
    if request.export:
        check_name(request.export, "export")
        if request.base_model:
            raise InvalidArgument("sample: an export or the base model, not both")
    elif request.live_at is not None or request.export_gone:
        raise InvalidArgument("sample: live_at and export_gone are about an export; name it")


def sample(run: ActiveRun, request: SampleRequest, _: Applying | None) -> SampleResult:
    """Samples (and the prompt's logprobs) under the weights the request selects; the engine
    swaps other weights in and back itself, inside its guard."""
    session = run.session
    weights = sample_weights(run, request)
    scoring = prompt_scoring(request)
    if scoring.asked:  # refused before any sample is drawn
        scoring.check(request.prompt_tokens, session.sampler.vocab_size, session.sampler.limits)
    samples = session.sample(
        request.prompt_tokens,
        weights=weights,
        topk_sample_logprobs=request.topk_sample_logprobs,
        **request.sampling_settings(),
    )
    if not scoring.asked:
        return SampleResult(samples)
    scored = session.prompt_scores(request.prompt_tokens, scoring, weights=weights)
    return SampleResult(samples, scored)


def resolve_snapshot(run: ActiveRun, request: SampleRequest) -> SampleRequest:
    """``request`` with its weights decided now, at its turn: an export written at the live
    weights' version (``live_at``) reads the live weights while they are still that version,
    else the export (refused with ``export_gone`` where the export is known gone)."""
    if request.live_at is None:
        return request
    if request.live_at == run.session.weights_version and not request.export_run:
        return dataclasses.replace(request, export="", live_at=None, export_gone="")
    if request.export_gone:
        raise FailedPrecondition(request.export_gone)
    return dataclasses.replace(request, live_at=None)


def sample_weights(run: ActiveRun, request: SampleRequest) -> SampleWeights:
    """The weights ``request`` reads: the live ones, an export of this run or of the run
    ``export_run``, or the base model."""
    assert request.live_at is None, "resolve_snapshot first"
    if request.export:
        saved_by = sibling_run(run.run, request.export_run) if request.export_run else run.run
        return SampleWeights(export=saved_by.export(request.export))
    return BASE_MODEL if request.base_model else LIVE_WEIGHTS


def check_discard(request: DiscardExportsRequest, _root: Path | None) -> None:
    for name in request.names:
        check_name(name, "export")


def discard_exports(run: ActiveRun, request: DiscardExportsRequest, _: Applying | None) -> None:
    """On the engine thread, so no sample is reading them; exports change no continuation state."""
    for name in request.names:
        shutil.rmtree(run.run.export(name), ignore_errors=True)


def tokenize(run: ActiveRun, request: TokenizeRequest, _: Applying | None) -> list[list[int]]:
    return run.session.tokenize(request.texts, add_special_tokens=request.add_special_tokens)


def detokenize(run: ActiveRun, request: DetokenizeRequest, _: Applying | None) -> list[str]:
    return run.session.detokenize(request.token_lists)
