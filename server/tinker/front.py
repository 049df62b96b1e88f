"""The Tinker front: the SDK's calls mapped onto the server's one ``SessionHost``.

Every training call of the SDK carries ``(model_id, seq_id)``; ``{model_id}/{seq_id}`` is both its
request id and its trainwire operation key, so a re-sent call finds its future (and, after it ran,
the journal's recorded result) instead of running again. Calls run in seq_id order per model
(``SeqOrder``); their results enter the ``FutureStore`` only after ``SessionHost`` returned, which
for a state-changing call is after its journal commit: a poll never sees a result a crash could
take back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainwire.client.outcomes import OperationSpec, WeightsSource
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from trainwire.server.host import SessionHost
from trainwire.server.model_loading import resolve_under
from trainwire.server.tinker import codec
from trainwire.server.tinker.futures import Done, Failed, FutureStore, Outcome
from trainwire.server.tinker.losses import elementwise_loss
from trainwire.server.tinker.model import ModelRecord, check_adam_params, run_id_for
from trainwire.server.tinker.model import training_config as config_of
from trainwire.server.tinker.ordering import SeqOrder
from trainwire.server.tinker.samplers import Samplers

logger = logging.getLogger(__name__)

FRONT_DIR = "tinker"  # the front's own files, beside the runs in the state directory
USER_ERRORS = (InvalidArgument, FailedPrecondition, NotFound, ValueError)


def digest(value: Any) -> str:
    """What a seq_id is bound to: a re-send must carry the same payload."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


class TinkerFront:
    """One server's SDK state: its sessions, the one model, its sampling sessions, futures."""

    def __init__(self, host: SessionHost, *, tokenizer_id: str | None = None) -> None:
        self.host = host
        self.tokenizer_id = tokenizer_id
        self.directory = Path(host.state_dir.root) / FRONT_DIR
        self.futures = FutureStore()
        self.order = SeqOrder(lambda job: job())
        self.samplers = Samplers()
        self.sessions: set[str] = set()
        self._lock = threading.Lock()
        self.model = ModelRecord.load(self.directory)
        if self.model is not None:
            self.sessions.add(self.model.session_id)
            self.order.start_model(self.model.model_id)

    def stop(self) -> None:
        self.order.stop()

    # -- sessions ------------------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = f"tw-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self.sessions.add(session_id)
        return session_id

    def require_session(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise NotFound(f"no session {session_id!r} on this server; create_session first")

    def finish_session(self, session_id: str) -> None:
        """The SDK closed its ServiceClient: its model's run closes (a new one may be created)."""
        self.require_session(session_id)
        model = self.model
        if model is not None and model.session_id == session_id:
            self.host.close()
            (self.directory / "model.json").unlink(missing_ok=True)
            self.model = None
        self.sessions.discard(session_id)

    # -- the model -----------------------------------------------------------------------------

    def create_model(self, body: dict[str, Any]) -> str:
        """Open the server's one run for this model; its request id resolves at once."""
        session_id = str(body.get("session_id", ""))
        self.require_session(session_id)
        config = config_of(body)
        model_dir = resolve_under(self.host.model_root, config.model, "base_model")
        if not model_dir.is_dir():
            raise NotFound(f"create_model: no model {config.model!r} under the model root")
        model_id = f"{session_id}:train:{int(body.get('model_seq_id', 0))}"
        with self._lock:
            if self.model is not None and self.model.model_id != model_id:
                raise FailedPrecondition(
                    f"this server already trains model {self.model.model_id!r} (one server, one "
                    "model): close that ServiceClient first, or start another server"
                )
            record = ModelRecord(
                model_id,
                run_id_for(model_id),
                session_id,
                config.model,
                self.tokenizer_id or str(model_dir),
                config.lora.r if config.lora else None,
            )
            self.host.open(record.run_id, config)
            record.save(self.directory)
            self.model = record
            self.order.start_model(model_id)
        request_id = f"{model_id}/create"
        self.futures.add(request_id)
        self.futures.resolve(request_id, Done({"model_id": model_id, "type": "create_model"}))
        return request_id

    def require_model(self, model_id: str) -> ModelRecord:
        model = self.model
        if model is None or model.model_id != model_id:
            raise NotFound(f"no model {model_id!r} on this server; create_model first")
        return model

    # -- sequenced calls -----------------------------------------------------------------------

    def submit(self, model_id: str, seq_id: Any, payload: Any, call: Callable[[str], Any]) -> str:
        """Queue ``call(operation_key)`` as ``seq_id`` of ``model_id``; its request id."""
        self.require_model(model_id)
        if not isinstance(seq_id, int) or seq_id < 1:
            raise InvalidArgument(f"seq_id must be an integer >= 1, got {seq_id!r}")
        request_id = f"{model_id}/{seq_id}"

        def job() -> None:
            self.futures.resolve(request_id, run_to_outcome(lambda: call(request_id)))

        if self.order.submit(model_id, seq_id, digest(payload), job):
            self.futures.add(request_id)
        return request_id

    def forward_backward(self, body: bytes, content_encoding: str) -> str:
        request = codec.decode_forward_backward(body, content_encoding)
        loss = (request.loss_fn, request.loss_fn_config)
        examples = request.examples

        def call(key: str) -> bytes:
            if request.forward_only:
                outcome: Any = self.host.forward(examples, loss)
            else:
                outcome = self.host.forward_backward(examples, OperationSpec(key), loss)
            losses = elementwise_loss(request.loss_fn, request.loss_fn_config, examples, outcome)
            return codec.encode_forward_backward_output(outcome.logprobs, losses, outcome.metrics)

        return self.submit(request.model_id, request.seq_id, body, call)

    def optim_step(self, body: dict[str, Any]) -> str:
        learning_rate = check_adam_params(body)

        def call(key: str) -> dict[str, Any]:
            outcome = self.host.optim_step(OperationSpec(key), learning_rate=learning_rate)
            self.samplers.weights_changed()
            metrics = {
                "learning_rate:mean": outcome.learning_rate,
                "grad_norm:mean": outcome.grad_norm,
            }
            return {"type": "optim_step", "metrics": metrics}

        return self.submit(str(body.get("model_id")), body.get("seq_id"), body, call)

    def save_weights(self, body: dict[str, Any]) -> str:
        model_id, name = str(body.get("model_id")), str(body.get("path") or "")

        def call(key: str) -> dict[str, Any]:
            self.host.save_state(name, OperationSpec(key))
            return {"type": "save_weights", "path": f"tinker://{model_id}/weights/{name}"}

        return self.submit(model_id, body.get("seq_id"), body, call)

    def load_weights(self, body: dict[str, Any]) -> str:
        model_id = str(body.get("model_id"))
        name = checkpoint_name(str(body.get("path", "")), model_id, "weights")
        with_optimizer = bool(body.get("optimizer"))

        def call(key: str) -> dict[str, Any]:
            if with_optimizer:  # the engine restores a full state only into a fresh session
                self.host.load_state(name, OperationSpec(key))
            else:
                self.host.load_weights(WeightsSource("checkpoint", name), OperationSpec(key))
            self.samplers.weights_changed()
            return {"type": "load_weights", "path": body.get("path"), "model_id": model_id}

        return self.submit(model_id, body.get("seq_id"), body, call)

    def save_weights_for_sampler(self, body: dict[str, Any]) -> str:
        """A snapshot of the live weights for sampling clients (no files: see ``Samplers``)."""
        model_id, name = str(body.get("model_id")), body.get("path")
        session_id = self.require_model(model_id).session_id
        seq_id = body.get("seq_id")

        def call(key: str) -> dict[str, Any]:
            if name:
                path = f"tinker://{model_id}/sampler_weights/{name}"
                self.samplers.name_snapshot(path, seq_id)
                return {"type": "save_weights_for_sampler", "path": path}
            sampling_id = f"{session_id}:sample:{body.get('sampling_session_seq_id')}"
            self.samplers.create(sampling_id, self.model_name(), None, seq_id)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampling_id}

        return self.submit(model_id, seq_id, body, call)

    # -- sampling ------------------------------------------------------------------------------

    def model_name(self) -> str:
        return self.model.base_model if self.model is not None else ""

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        session_id = str(body.get("session_id", ""))
        self.require_session(session_id)
        sampling_id = f"{session_id}:sample:{body.get('sampling_session_seq_id')}"
        self.samplers.create_from(sampling_id, self.model_name(), body.get("model_path"))
        return sampling_id

    def asample(self, body: dict[str, Any]) -> tuple[str, list[str]]:
        request = codec.decode_sample(body)
        sampler = self.samplers.get(request.sampling_session_id)
        request_id = f"{request.sampling_session_id}/{request.seq_id}"
        ids = [f"{request_id}/{i}" for i in range(request.num_samples)]
        if self.futures.known(request_id):
            return request_id, ids
        self.futures.add(request_id)

        def job() -> None:
            def call() -> bytes:
                self.samplers.check_live(sampler)
                seed = request.seed
                if seed is None:  # the same loop twice draws the same samples
                    seed = int(digest([sampler.snapshot_seq, request.seq_id])[:15], 16)
                samples = self.host.sample(
                    request.prompt,
                    max_tokens=request.max_tokens,
                    num_samples=request.num_samples,
                    temperature=request.temperature,
                    top_p=request.top_p,
                    top_k=request.top_k,
                    stop_tokens=request.stop_tokens,
                    seed=seed,
                )
                scored = self.prompt_logprobs(request.prompt) if request.prompt_logprobs else None
                return codec.encode_sample_response(samples, scored)

            self.futures.resolve(request_id, run_to_outcome(call))

        self.order.run_unordered(job)
        return request_id, ids

    def prompt_logprobs(self, prompt: tuple[int, ...]) -> list[float]:
        """The trainer's logprob of each prompt token (NaN for the first: it has no context),
        from ``forward``, so they equal a forward_backward's bit for bit."""
        if len(prompt) < 2:
            return [float("nan")]
        from trainwire.client.tokens import TokenExample

        outcome = self.host.forward([TokenExample(prompt[:-1], prompt[1:])])
        return [float("nan"), *outcome.logprobs[0]]


def checkpoint_name(path: str, model_id: str, kind: str) -> str:
    """The checkpoint name in ``tinker://{model_id}/{kind}/{name}``, this model's only."""
    prefix = f"tinker://{model_id}/{kind}/"
    if not path.startswith(prefix) or len(path) == len(prefix):
        raise InvalidArgument(f"path {path!r}: this server loads {prefix}<name> paths only")
    return path[len(prefix) :]


def run_to_outcome(call: Callable[[], Any]) -> Outcome:
    """A call's result, or its error as the SDK's ``{"error", "category"}``."""
    try:
        return Done(call())
    except USER_ERRORS as error:
        return Failed(str(error), "user")
    except Unavailable as error:
        return Failed(str(error), "server")
    except Exception as error:
        logger.exception("a Tinker call failed")
        return Failed(f"{type(error).__name__}: {error}", "server")
