"""The SDK's sampling calls: snapshots, sampling sessions and ``asample``, on the front's
plumbing.

A sample runs outside the training sequence, on the weights of its sampler's snapshot (see
``samplers`` and ``snapshots``), so when it runs does not change what it draws; the front logs
the request before answering its id and the result before a poll sees it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainwire.client.outcomes import OperationSpec
from trainwire.server.errors import FailedPrecondition, NotFound
from trainwire.server.paths import resolve_under
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import ExportWeightsRequest
from trainwire.server.service.state_dir import check_name
from trainwire.server.tinker import codec
from trainwire.server.tinker.fields import get_int, get_str
from trainwire.server.tinker.ordering import digest
from trainwire.server.tinker.samplers import Sampler, snapshot_export
from trainwire.server.tinker.snapshots import SnapshotWeights, sample_from

if TYPE_CHECKING:
    from trainwire.server.tinker.front import TinkerFront


class SamplingRoutes:
    """``save_weights_for_sampler``, ``create_sampling_session`` and ``asample`` for one front."""

    def __init__(self, front: TinkerFront) -> None:
        self.front = front

    def save_weights_for_sampler(self, body: dict[str, Any]) -> str:
        """A snapshot of the live weights for sampling clients: a training call (it takes its
        seq_id) that writes the trainable weights as an export of the run."""
        front = self.front
        model_id, seq_id = get_str(body, "model_id", "") or "", body.get("seq_id")
        session_id = front.require_model(model_id).session_id

        def prepare() -> Callable[[str], dict[str, Any]]:
            name = get_str(body, "path")
            export = snapshot_export(seq_id if isinstance(seq_id, int) else 0, name)
            check_name(export, "save_weights_for_sampler path")
            path = f"tinker://{model_id}/sampler_weights/{name}" if name else ""
            sampling_seq = get_int(body, "sampling_session_seq_id")

            def call(key: str) -> dict[str, Any]:
                if path and front.samplers.named(path):  # its clients must keep their weights
                    raise FailedPrecondition(
                        f"sampler weights {path!r} exist already; save under a new name"
                    )
                snapshot = ExportWeightsRequest(export)
                front.host.apply(ops.EXPORT_WEIGHTS, snapshot, OperationSpec(key))
                model_name = front.model_name()
                if path:
                    front.samplers.snapshot(None, path, model_name, export, seq_id)
                    return {"type": "save_weights_for_sampler", "path": path}
                sampling_id = f"{session_id}:sample:{sampling_seq}"
                pruned = front.samplers.snapshot(sampling_id, None, model_name, export, seq_id)
                if pruned:
                    front.host.read_only(lambda _: self.remove_exports(pruned))
                return {"type": "save_weights_for_sampler", "sampling_session_id": sampling_id}

            return call

        return front.submit("save_weights_for_sampler", body, model_id, seq_id, prepare)

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        front = self.front
        session_id = get_str(body, "session_id", "") or ""
        front.require_session(session_id)
        sampling_id = f"{session_id}:sample:{get_int(body, 'sampling_session_seq_id')}"
        sampler = front.samplers.create_from(
            sampling_id, front.model_name(), get_str(body, "model_path")
        )
        front.record(sampler.record())  # a restart knows it before any sample asks for it
        return sampling_id

    def asample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        """The request id of a sample call and its sequences' ids, at once."""
        request = codec.decode_sample(body)
        request_id = f"{request.sampling_session_id}/{request.seq_id}"
        if not self.front.replay_pending():  # after a restart, a replayed call may create it
            self.front.samplers.get(request.sampling_session_id)  # unknown: 404 at once

        def call() -> bytes:
            # Looked up when it runs: after a restart, the call that creates it runs first.
            sampler = self.front.samplers.get(request.sampling_session_id)
            seed = request.seed
            if seed is None:  # the same loop twice draws the same samples
                seed = int(digest([sampler.snapshot_seq, request.seq_id])[:15], 16)
            weights = self.weights_of(sampler)
            samples, scored = self.front.host.read_only(
                lambda session: sample_from(
                    session,
                    weights,
                    request.prompt,
                    prompt_logprobs=request.prompt_logprobs,
                    max_tokens=request.max_tokens,
                    num_samples=request.num_samples,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    top_k=request.top_k,
                    stop_tokens=request.stop_tokens,
                    seed=seed,
                )
            )
            return codec.encode_sample_response(samples, scored)

        self.front.submit_unordered(request_id, body, call)
        return request_id, [f"{request_id}/{i}" for i in range(request.num_samples)]

    def remove_exports(self, names: list[str]) -> None:
        """Unnamed snapshots past what is kept (on the executor: no sample is reading them)."""
        model = self.front.model
        if model is None:
            return
        run = self.front.host.state_dir.run(model.run_id)
        for name in names:
            shutil.rmtree(run.export(name), ignore_errors=True)

    def weights_of(self, sampler: Sampler) -> SnapshotWeights:
        """Where ``sampler``'s weights are now: live, in its export, or the base model's."""
        front = self.front
        if front.samplers.is_live(sampler):
            return SnapshotWeights(live=True)
        model = front.model
        if model is None:
            raise NotFound("no model on this server: its sampling clients ended with it")
        if sampler.export is not None:
            run = front.host.state_dir.run(model.run_id)
            return SnapshotWeights(live=False, export=run.export(sampler.export))
        base = resolve_under(front.host.model_root, model.base_model, "base_model")
        return SnapshotWeights(live=False, base_model=base)
