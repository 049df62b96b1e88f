"""The SDK's sampling calls, as plain functions: snapshots, sampling sessions and ``asample``.

A sampling client samples the weights of its snapshot, never weights trained after it
(``sampling_sessions``). ``save_weights_for_sampler`` is a training call (it takes its seq_id)
that writes the trainable weights as an export of the run; a sample then names that export to
the host's ``Sample`` operation, and the engine swaps it in for the call, unless the trainer has
not changed its weights since (then the live weights are the snapshot, at no cost). A sample runs
outside the training sequence, so when it runs does not change what it draws; the intake logs
the request before answering its id and the result before a poll sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.server.service import operations as ops
from trainwire.server.service.intake import SampleSubmission, Submission
from trainwire.server.service.reads import SampleResult
from trainwire.server.service.request_records import digest
from trainwire.server.service.requests import (
    ExportWeightsRequest,
    SampleRequest,
)
from trainwire.server.service.state_dir import check_name
from trainwire.server.tinker import sample_codec, save_notes
from trainwire.server.tinker.catalog import TinkerPath, check_ttl
from trainwire.server.tinker.codec import BYTES_PER_DECODED_VALUE
from trainwire.server.tinker.fields import get_int, get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.sampling_sessions import SamplingSession, snapshot_export
from trainwire.server.tinker.save_notes import SamplerSnapshot
from trainwire.server.tinker.tenancy import tenant_of, visible

SAMPLE_CALL_BYTES = 4096  # a decoded sample's call, settings and closure, past its tokens


def save_weights_for_sampler(front: TinkerFront, body: dict[str, Any]) -> str:
    """A snapshot of the live weights for sampling clients, named (``path``) or for a new
    sampling session; unnamed snapshots past the newest few are removed. ``kind`` "inflight":
    the model's inflight weights move to this snapshot, for the new sampling session and every
    inflight one of the model made before (``SamplingSessions.snapshot``)."""
    model_id, seq_id = get_str(body, "model_id", "") or "", body.get("seq_id")
    model = front.models.require_model(model_id)
    sampling_seq = get_int(body, "sampling_session_seq_id")
    sampling_id = f"{model.session_id}:sample:{sampling_seq}"

    def prepare() -> Submission:
        name = get_str(body, "path")
        inflight = sampling_kind(body, named=bool(name))
        export = snapshot_export(seq_id if isinstance(seq_id, int) else 0, name)
        check_name(export, "save_weights_for_sampler path")
        path = f"tinker://{model_id}/sampler_weights/{name}" if name else ""
        ttl = check_ttl(body.get("ttl_seconds"), "save_weights_for_sampler")
        # Named weights are written once: their sampling clients keep reading them.
        once = f"sampler weights {path!r}" if path else ""
        export_request = ExportWeightsRequest(export, written_once=once)
        note = SamplerSnapshot(
            model_id,
            model.run_id,
            model.base_model,
            export,
            seq_id,
            path,
            name or "",
            sampling_id,
            ttl,
            inflight,
        )
        answer = "save_weights_for_sampler"
        return Submission(ops.EXPORT_WEIGHTS, export_request, answer, save_notes.to_json(note))

    # A re-send may carry another sampling_session_seq_id: only the first try's session is made.
    new = not front.intake.results.known(f"{model_id}/{seq_id}")
    identity = snapshot_identity(body)
    request_id = front.submit(body, model_id, seq_id, prepare, identity=identity)
    if new and not get_str(body, "path"):
        front.sampling_sessions.expect(sampling_id, model_id)  # its samples take model's turns
    return request_id


def snapshot_identity(body: Any) -> Any:
    """What identifies a ``save_weights_for_sampler``: its body but ``sampling_session_seq_id``,
    which the SDK draws anew on every try of the same call (same seq_id). A re-send after a
    lost answer is then answered the first try's sampling session, whose id the SDK takes from
    the answer."""
    if not isinstance(body, dict):
        return body
    return {k: v for k, v in body.items() if k != "sampling_session_seq_id"}


def sampling_kind(body: dict[str, Any], *, named: bool) -> bool:
    """Whether a ``save_weights_for_sampler`` is of kind ``inflight`` (else ``snapshot``);
    InvalidArgument for another kind, or for named inflight weights."""
    kind = get_str(body, "kind", "snapshot") or "snapshot"
    if kind not in ("snapshot", "inflight"):
        raise InvalidArgument(f"save_weights_for_sampler: kind {kind!r}: snapshot or inflight")
    if kind == "inflight" and named:
        raise InvalidArgument(
            "save_weights_for_sampler: inflight weights have no name (they move with each "
            "inflight save); save named weights as a snapshot"
        )
    return kind == "inflight"


def create_sampling_session(front: TinkerFront, body: dict[str, Any]) -> str:
    """A sampling session on named sampler weights, or on the base model."""
    session_id = get_str(body, "session_id", "") or ""
    front.models.require_session(session_id)
    sampling_id = f"{session_id}:sample:{get_int(body, 'sampling_session_seq_id')}"
    model_path = get_str(body, "model_path")
    base_model = front.models.model_name()
    named = get_str(body, "base_model") if model_path is None else None
    if named:  # the base model the caller names, never another one
        front.models.base_model_dir(named, "create_sampling_session")
        base_model = named
    sampler = front.sampling_sessions.create_from(
        sampling_id, base_model, model_path, saved_elsewhere(front, model_path)
    )
    front.intake.record(sampler.record())  # a restart knows it before any sample asks
    return sampling_id


def saved_elsewhere(front: TinkerFront, model_path: str | None) -> SamplingSession | None:
    """Sampler weights of a model that is not open (closed since), as the catalog keeps them;
    None for an open model's own or the base model."""
    if model_path is None or front.sampling_sessions.named(model_path):
        return None
    path = TinkerPath.parse(model_path)
    if path.segment != "sampler_weights":
        raise InvalidArgument(
            f"model_path {model_path!r}: a sampling client reads sampler weights "
            "(tinker://<run>/sampler_weights/<name>, from save_weights_for_sampler)"
        )
    record, saved = front.catalog.find(path)
    run = "" if front.models.by_run(record.run_id) is not None else record.run_id
    return SamplingSession(
        "", record.base_model, model_path, saved.stored_as, 0, None, run, path.model_id
    )


def asample(front: TinkerFront, body: dict[str, Any]) -> tuple[str, list[str]]:
    """The request id of a sample call and its sequences' ids, at once."""
    request = sample_codec.decode_sample(body)
    request_id = f"{request.sampling_session_id}/{request.seq_id}"
    # Unknown: 404 at once (after a restart, unless a replayed call is to make it again).
    replaying = front.intake.replay_pending()
    front.sampling_sessions.require(request.sampling_session_id, replaying=replaying)

    def prepare() -> tuple[str, SampleRequest]:
        # Looked up at its turn: after a restart, the call that creates it runs first.
        sampler = front.sampling_sessions.get(request.sampling_session_id)
        run_id, weights = _weights_of(front, front.sampling_sessions.target(sampler))
        seed = request.seed
        if seed is None:  # the same loop twice draws the same samples
            seed = int(digest([sampler.snapshot_seq, request.seq_id])[:15], 16)
        sample = SampleRequest(
            request.prompt,
            max_tokens=request.max_tokens,
            num_samples=request.num_samples,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stop_tokens=request.stop_tokens,
            stop_strings=request.stop_strings,
            seed=seed,
            prompt_logprobs=request.prompt_logprobs,
            topk_sample_logprobs=request.topk_sample_logprobs,
            topk_prompt_logprobs=request.topk_prompt_logprobs,
            prompt_logprobs_last_n=request.prompt_logprobs_last_n,
            target_prompt_logprobs=request.target_prompt_logprobs,
            **weights,
        )
        return run_id, sample

    def encode(result: SampleResult) -> bytes:
        return sample_codec.encode_sample_response(result.samples, result.prompt_logprobs)

    turns = _run_whose_turns_it_takes(front, request.sampling_session_id)
    with accepting_sample(front, request.sampling_session_id):
        sample = SampleSubmission(prepare, encode)
        front.intake.submit_unordered(
            request_id, body, sample, size=held_bytes(request), run_id=turns
        )
    return request_id, [f"{request_id}/{i}" for i in range(request.num_samples)]


@contextlib.contextmanager
def accepting_sample(front: TinkerFront, sampling_id: str) -> Iterator[None]:
    """Around a sample's acceptance: its sampler weights must be readable to its sender
    (``require_readable``; not for a request accepted before a restart: it reads what it read
    then), and count as read by it until it is accepted, when a delete sees it waiting
    (``saved_checkpoints.sample_readers``). Under the catalog's removal guard, so a delete
    comes wholly before the check or sees the sample."""
    try:
        path = str(TinkerPath.parse(front.sampling_sessions.get(sampling_id).model_path))
    except (NotFound, InvalidArgument):  # one a replayed call makes, or base/unnamed weights
        path = ""
    with front.catalog.removal_guard:
        if not front.intake.taking_back:
            require_readable(front, sampling_id)
        front.catalog.samples_accepting[path] += 1
    try:
        yield
    finally:
        with front.catalog.removal_guard:
            front.catalog.samples_accepting[path] -= 1
            if not front.catalog.samples_accepting[path]:
                del front.catalog.samples_accepting[path]


def require_readable(front: TinkerFront, sampling_id: str) -> None:
    """NotFound, as for a path that is not there, when ``sampling_id`` samples another
    tenant's sampler weights that the caller may no longer read: unpublished (or deleted, or
    past their TTL) since the sampling client was made. The files stay while the owner's run
    keeps them, so samples accepted before still run; a new one is refused at once."""
    try:
        sampler = front.sampling_sessions.get(sampling_id)
    except NotFound:  # one a replayed snapshot call is to make: its own model's weights
        return
    if sampler.model_path and not visible(sampler.model_path):
        front.catalog.find(TinkerPath.parse(sampler.model_path))


def _run_whose_turns_it_takes(front: TinkerFront, sampling_id: str) -> str:
    """The run whose turns a sample of ``sampling_id`` takes: its model's while that is open
    (after a restart, the model whose replayed call makes the sampling session: the sample
    waits behind it), else none ("": which run samples it is chosen when it runs)."""
    model_id = front.sampling_sessions.model_of(sampling_id)
    model = front.models.by_run(run_id_for(model_id)) if model_id else None
    return model.run_id if model is not None else ""


def cancel_sample(front: TinkerFront, request_id: str) -> bool:
    """``cancel_future``: a sample not answered yet is answered as cancelled, durably, and is
    not run (or, running, its result is discarded); one answered already keeps its answer
    (False). A training call is refused (400): it holds its place in its model's seq_ids, and
    the calls after it expect its effect. NotFound for a request this server does not know (or
    another tenant's)."""
    stream = request_id.rpartition("/")[0]
    if not visible(request_id) or not front.intake.results.known(request_id):
        raise NotFound(f"no request {request_id!r} on this server")
    if ":sample:" not in stream:
        raise InvalidArgument(
            f"request {request_id!r} is a training call: only samples can be cancelled (a "
            "training call keeps its place in its model's order; the calls after it expect it)"
        )
    try:
        return front.intake.cancel(request_id)
    except KeyError:
        raise NotFound(f"no request {request_id!r} on this server") from None


def held_bytes(request: sample_codec.SampleCall) -> int:
    """What a decoded sample request holds until it has run: its prompt, stop tokens and target
    ids as objects (``codec.BYTES_PER_DECODED_VALUE`` each), its stop strings, and the call."""
    targets = sum(len(row) for row in request.target_prompt_logprobs or ())
    values = len(request.prompt) + len(request.stop_tokens) + targets
    strings = sum(len(text) for text in request.stop_strings)
    return values * BYTES_PER_DECODED_VALUE + 4 * strings + SAMPLE_CALL_BYTES


def _weights_of(front: TinkerFront, sampler: SamplingSession) -> tuple[str, dict[str, Any]]:
    """Which run samples for ``sampler`` now, and which weights, as ``SampleRequest`` fields:
    its model's run, with the live weights while they are its snapshot, else its snapshot's
    export; the base model on an open run of it, or on a run opened to sample it; a closed
    run's export on an open run of its base model, or on a run opened to sample it."""
    saved_by = sampler.export_run or (run_id_for(sampler.model_id) if sampler.model_id else "")
    owner = front.models.by_run(saved_by) if saved_by else None
    if owner is not None and sampler.export is not None:  # its model is open
        # The live weights while they are still the snapshot's (the service decides at the
        # sample's turn), else the export, unless it was pruned.
        weights: dict[str, Any] = {"export": sampler.export}
        if not sampler.export_run and sampler.weights_version is not None:
            weights["live_at"] = sampler.weights_version
        if front.sampling_sessions.pruned(sampler):
            weights["export_gone"] = (
                f"the snapshot {sampler.export!r} of this sampling client was pruned (the server "
                "keeps the newest unnamed snapshots only); call "
                "save_weights_and_get_sampling_client() again, or save it under a name"
            )
            if "live_at" not in weights:
                raise FailedPrecondition(weights["export_gone"])
        return owner.run_id, weights
    models = front.models.open_models()
    if sampler.export is None:  # the base model, which every open model's run of it holds
        if not models and sampler.base_model:  # evaluating a base before any training: a
            # run of it is opened to sample on (a model created later takes its place)
            config = front.models.base_sampling_config(sampler.base_model)
            tenant = tenant_of(sampler.sampling_session_id)
            return front.models.open_for_sampling(config, tenant), {"base_model": True}
        if not models:
            raise NotFound(
                "no model is open on this server to sample the base model on: name it "
                "(create_sampling_client(base_model=...)) or create a training client of it"
            )
        # A client that named no base model samples the open model's ("" when none was open).
        wanted = sampler.base_model or models[0].base_model
        of_base = [model for model in models if model.base_model == wanted]
        if not of_base:
            raise FailedPrecondition(
                f"this sampling client samples {sampler.base_model!r}; the open model is "
                f"{models[0].base_model!r}: open one of {sampler.base_model!r} (on a server "
                "without other models) to sample it"
            )
        return of_base[0].run_id, {"base_model": True}
    weights = {"export": sampler.export, "export_run": saved_by}
    if not models:
        source = front.catalog.run(TinkerPath.parse(sampler.model_path or "").model_id)
        tenant = tenant_of(sampler.sampling_session_id)
        config = TrainingConfig.from_dict(source.config)
        return front.models.open_for_sampling(config, tenant), weights
    fitting = [model for model in models if model.base_model == sampler.base_model]
    if not fitting:
        raise FailedPrecondition(
            f"sampler weights {sampler.model_path} are of {sampler.base_model!r}; the open "
            f"model is {models[0].base_model!r}: open one of {sampler.base_model!r} (on a "
            "server without other models) to sample them"
        )
    return fitting[0].run_id, weights
