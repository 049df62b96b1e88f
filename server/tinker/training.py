"""The SDK's training calls: forward_backward (and forward), optim_step, save_weights and
load_weights, on the front's plumbing (``TinkerFront.submit``).

Each route reads the call's ``(model_id, seq_id)`` and hands ``submit`` a ``prepare`` closure:
it checks the rest of the request and returns the engine call. A refused request still takes its
seq_id (the SDK has already numbered the calls after it), so the calls behind it are not held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainwire.client.outcomes import OperationSpec, WeightsSource
from trainwire.server.errors import FailedPrecondition
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    CheckpointRequest,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadWeightsRequest,
    OptimStepRequest,
)
from trainwire.server.service.state_dir import check_name
from trainwire.server.tinker import codec
from trainwire.server.tinker.fields import get_bool, get_str
from trainwire.server.tinker.losses import elementwise_loss
from trainwire.server.tinker.model import check_adam_params, checkpoint_name

if TYPE_CHECKING:
    from trainwire.server.tinker.front import TinkerFront

Call = Callable[[str], Any]  # the engine call, given its operation key


class TrainingRoutes:
    """``forward_backward``, ``optim_step``, ``save_weights`` and ``load_weights`` for one
    front."""

    def __init__(self, front: TinkerFront) -> None:
        self.front = front

    def forward_backward(self, body: bytes, content_encoding: str) -> str:
        message = codec.parse_forward_backward(body, content_encoding)
        forward_only = message.forward_only

        def prepare() -> Call:
            request = codec.forward_backward_call(message)
            loss = (request.loss_fn, request.loss_fn_config)
            examples = request.examples
            host = self.front.host

            def call(key: str) -> Callable[[], bytes]:
                if forward_only:
                    forward = ForwardRequest(examples, *loss)
                    outcome: Any = host.apply(ops.FORWARD, forward)
                else:
                    batch = ForwardBackwardRequest(examples, *loss)
                    outcome = host.apply(ops.FORWARD_BACKWARD, batch, OperationSpec(key))

                def encode() -> bytes:  # behind: the next call runs meanwhile
                    config = request.loss_fn_config
                    losses = elementwise_loss(request.loss_fn, config, examples, outcome)
                    return codec.encode_forward_backward_output(
                        outcome.logprobs, losses, outcome.metrics
                    )

                return encode

            return call

        return self.front.submit(
            "forward_backward",
            body,
            message.model_id,
            message.seq_id,
            prepare,
            encoding=content_encoding,
            keyed=not forward_only,
        )

    def optim_step(self, body: dict[str, Any]) -> str:
        front = self.front

        def prepare() -> Call:
            learning_rate = check_adam_params(body)

            def call(key: str) -> dict[str, Any]:
                # Tinker adds the gradients of every forward_backward since the last step.
                step = OptimStepRequest(learning_rate, sum_microbatches=True)
                outcome = front.host.apply(ops.OPTIM_STEP, step, OperationSpec(key))
                front.samplers.weights_changed()
                metrics = {
                    "learning_rate:mean": outcome.learning_rate,
                    "grad_norm:mean": outcome.grad_norm,
                }
                return {"type": "optim_step", "metrics": metrics}

            return call

        model_id = get_str(body, "model_id", "") or ""
        return front.submit("optim_step", body, model_id, body.get("seq_id"), prepare)

    def save_weights(self, body: dict[str, Any]) -> str:
        front = self.front
        model_id, seq_id = get_str(body, "model_id", "") or "", body.get("seq_id")

        def prepare() -> Call:
            name = check_name(get_str(body, "path", "") or "", "save_weights path")

            def call(key: str) -> dict[str, Any]:
                save = CheckpointRequest(name)
                outcome = front.host.apply(ops.SAVE_STATE, save, OperationSpec(key))
                front.compact_at(seq_id, outcome.position)
                return {"type": "save_weights", "path": f"tinker://{model_id}/weights/{name}"}

            return call

        return front.submit("save_weights", body, model_id, seq_id, prepare)

    def load_weights(self, body: dict[str, Any]) -> str:
        front = self.front
        model_id = get_str(body, "model_id", "") or ""
        if not model_id and body.get("session_id") is not None:
            raise FailedPrecondition(
                "create_training_client_from_state is not served here: one server trains one "
                "model, and a checkpoint loads into the model that saved it "
                "(training_client.load_state)"
            )

        def prepare() -> Call:
            name = checkpoint_name(get_str(body, "path", "") or "", model_id, "weights")
            with_optimizer = get_bool(body, "optimizer")

            def call(key: str) -> dict[str, Any]:
                if with_optimizer:  # the engine restores a full state only into a fresh session
                    load = CheckpointRequest(name)
                    front.host.apply(ops.LOAD_STATE, load, OperationSpec(key))
                else:
                    weights = LoadWeightsRequest(WeightsSource("checkpoint", name))
                    front.host.apply(ops.LOAD_WEIGHTS, weights, OperationSpec(key))
                front.samplers.weights_changed()
                return {"type": "load_weights", "path": body.get("path"), "model_id": model_id}

            return call

        return front.submit("load_weights", body, model_id, body.get("seq_id"), prepare)
