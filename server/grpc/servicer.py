"""The gRPC servicer: decode the request, call the host's operation table, encode the outcome.

Decoding ends here: the host takes typed requests (a ``TrainingConfig``, ``max_steps`` as
``int | None``), never JSON or proto3 defaults. Errors become status codes through the one map
both transports share (``errors.STATUSES``), and every call is logged as one JSON line at debug
level: kind, operation key, result (applied, replayed or the status), position, duration.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from trainwire.contract import chunks, codec, outcomes
from trainwire.contract.config import TrainingConfig
from trainwire.server.errors import (
    InvalidArgument,
    PositionMismatch,
    TrainwireError,
    exhaustion_advice,
    status_of,
)
from trainwire.server.grpc.run_access import RunAccess
from trainwire.server.service import operations as ops
from trainwire.server.service import requests
from trainwire.server.service.host import SessionHost
from trainwire.server.service.state_dir import check_name, read_export_files
from trainwire.v1 import session_pb2 as pb
from trainwire.v1 import session_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")


def status_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status a failed call reports for ``error`` (``errors.STATUSES``)."""
    return grpc.StatusCode[status_of(error).grpc]


def status_message(error: BaseException) -> str:
    """What a failed call says: the error's own message, with advice where the library's has
    none (memory or disk ran out outside the engine's own checks)."""
    message = str(error) or type(error).__name__
    advice = None if isinstance(error, TrainwireError) else exhaustion_advice(error)
    return f"{advice} ({message})" if advice else message


# The refusals an operator acts on (memory, disk or the queue ran out); every
# other refusal is the caller's to act on, and the caller receives it.
OPERATOR_STATUSES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


def log_operation(kind: str, key: str, started: float, result: str, **fields: Any) -> None:
    """Every call as one JSON line at debug level (kind, key, result, position, duration):
    per-operation detail for ``trainwire serve -v``. An operator's INFO log holds what they act
    on instead: runs opened, restored and closed (the host's), refusals they can fix."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    line = {"kind": kind, "key": key, "result": result, **fields}
    line["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
    logger.debug("operation %s", json.dumps(line, sort_keys=True))


def config_from_json(config_json: str) -> TrainingConfig:
    """An Open request's ``config_json``; INVALID_ARGUMENT naming what is wrong with it."""
    try:
        data = json.loads(config_json)
    except ValueError as error:
        raise InvalidArgument(f"config_json is not valid JSON: {error}") from None
    except RecursionError:
        raise InvalidArgument(
            "config_json is nested too deeply to be a training config; send the flat object "
            "TrainingConfig.to_dict() gives"
        ) from None
    try:
        return TrainingConfig.from_dict(data)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def max_steps_from_proto(max_steps: int) -> int | None:
    """proto3 sends 0 for "not given": None, which accepts an open run's."""
    if max_steps < 0:
        raise InvalidArgument(f"max_steps must be positive (or 0: none), got {max_steps}")
    return max_steps or None


def batch_from_proto(
    request: pb.ForwardRequest | pb.ForwardBackwardRequest,
    request_type: type[requests.ForwardRequest],
) -> requests.ForwardRequest:
    """A request's examples (text or tokens, never both) and its loss; ValueError when bad."""
    if request.examples and request.token_examples:
        raise InvalidArgument("send examples or token_examples, not both")
    loss_fn, loss_fn_config = codec.loss_spec_from_proto(request.loss)
    if request.token_examples:
        examples: requests.Examples = codec.token_examples_from_proto(request.token_examples)
    else:
        examples = codec.examples_from_proto(request.examples)
    return request_type(examples, loss_fn, loss_fn_config)


OPTIM_STEP_SETTINGS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm")


def optim_step_from_proto(request: pb.OptimStepRequest) -> requests.OptimStepRequest:
    """Each setting the request sets (proto3 ``optional``: unset is the run's own)."""
    given = {name: getattr(request, name) for name in OPTIM_STEP_SETTINGS if request.HasField(name)}
    return requests.OptimStepRequest(**given)


class TrainingSessionServicer(pb_grpc.TrainingSessionServiceServicer):
    """``trainwire.v1.TrainingSessionService`` over a ``SessionHost``; with ``access``, each
    call reaches only its tenant's run."""

    def __init__(self, session_host: SessionHost, access: RunAccess | None = None) -> None:
        self.session_host = session_host
        self.access = access

    def _guarded(
        self, context: grpc.ServicerContext, check: Callable[..., None], *args: Any
    ) -> str:
        """``check(access, caller, *args)`` when the port has tenants (a keyless one has none);
        the caller, whose bound of waiting calls the call counts against ("": no tenants)."""
        caller = self._caller(context)
        if self.access is not None:
            check(self.access, caller, *args)
        return caller

    def _caller(self, context: grpc.ServicerContext) -> str:
        """The tenant whose key the call shows ("" on a port without tenants)."""
        if self.access is None:
            return ""
        return self.access.caller(context.invocation_metadata())

    def _admission(
        self, context: grpc.ServicerContext, check: Callable[..., None], *args: Any
    ) -> Callable[[], None] | None:
        """``check(access, caller, *args)`` for the host to run where it must be atomic with
        what it admits (None on a port without tenants); the caller is read here, from the
        call's metadata."""
        if self.access is None:
            return None
        return partial(check, self.access, self._caller(context), *args)

    def _own_info(self, context: grpc.ServicerContext, info: Any) -> Any:
        """``info``, unless it describes another tenant's run (NotFound)."""
        if self.access is None:
            return info
        return self.access.visible(self.access.caller(context.invocation_metadata()), info)

    def _run(self, context: grpc.ServicerContext, kind: str, key: str, call: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            outcome = call()
        except Exception as error:
            code = status_code(error)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed unexpectedly", kind)
            elif code in OPERATOR_STATUSES:
                logger.warning("%s refused (%s): %s", kind, code.name, status_message(error))
            log_operation(kind, key, started, code.name, message=str(error))
            if isinstance(error, PositionMismatch):
                context.set_trailing_metadata(((codec.POSITION_METADATA_KEY, str(error.position)),))
            context.abort(code, status_message(error))
        replayed = getattr(outcome, "replayed", False)
        fields = {"position": outcome.position} if hasattr(outcome, "position") else {}
        log_operation(kind, key, started, "replayed" if replayed else "ok", **fields)
        return outcome

    def Open(self, request: pb.OpenRequest, context: grpc.ServicerContext) -> pb.OpenResponse:
        def call() -> outcomes.OpenOutcome:
            check_name(request.run_id, "run id")  # a bad run id is the first thing refused
            config = config_from_json(request.config_json)
            max_steps = max_steps_from_proto(request.max_steps)
            return self.session_host.open(
                request.run_id,
                config,
                max_steps,
                request.plan_fingerprint,
                admit=self._admission(context, RunAccess.check_open, request.run_id),
                account=self._caller(context),
            )

        outcome = self._run(context, "Open", "", call)
        return codec.open_response_to_proto(outcome)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        def call() -> outcomes.SessionInfo:
            if request.run_id:  # another tenant's answers as a run id nobody opened
                self._guarded(context, RunAccess.check_named, request.run_id)
            return self._own_info(context, self.session_host.info(request.run_id))

        info = self._run(context, "Info", "", call)
        return pb.InfoResponse(info=codec.session_info_to_proto(info))

    def ListRuns(self, request: pb.ListRunsRequest, context) -> pb.ListRunsResponse:
        def call() -> list[outcomes.SessionInfo]:
            runs = self.session_host.runs()
            if self.access is None:
                return runs
            caller = self.access.caller(context.invocation_metadata())
            return [info for info in runs if self.access.owners.holds(info.run_id, caller)]

        runs = self._run(context, "ListRuns", "", call)
        return pb.ListRunsResponse(runs=[codec.session_info_to_proto(info) for info in runs])

    def _apply(
        self,
        context: grpc.ServicerContext,
        operation: ops.Operation[Any],
        decode: Callable[[], Any],
        op: outcomes.OperationSpec | None = None,
        *,
        run_id: str,
    ) -> Any:
        """Decode (inside the call, so a bad request is its status), then the operation table,
        for the run the request names ("" the open one)."""
        key = "" if op is None else op.key

        def call() -> Any:
            # The run checked is the run applied to: "" names the only open run, bound here.
            target = run_id or self.session_host.open_run_id or ""
            caller = self._guarded(context, RunAccess.check_run, run_id, target)
            return self.session_host.apply(operation, decode(), op, run_id=target, account=caller)

        return self._run(context, operation.kind, key, call)

    def Forward(self, request: pb.ForwardRequest, context) -> pb.ForwardResponse:
        decode = partial(batch_from_proto, request, requests.ForwardRequest)
        return codec.forward_to_proto(
            self._apply(context, ops.FORWARD, decode, run_id=request.run_id)
        )

    def ForwardBackward(self, request: pb.ForwardBackwardRequest, context):
        op = codec.operation_from_proto(request.operation)
        decode = partial(batch_from_proto, request, requests.ForwardBackwardRequest)
        outcome = self._apply(context, ops.FORWARD_BACKWARD, decode, op, run_id=request.run_id)
        return codec.forward_backward_to_proto(outcome)

    def OptimStep(self, request: pb.OptimStepRequest, context) -> pb.OptimStepResponse:
        op = codec.operation_from_proto(request.operation)
        decode = partial(optim_step_from_proto, request)
        return codec.optim_step_to_proto(
            self._apply(context, ops.OPTIM_STEP, decode, op, run_id=request.run_id)
        )

    def Sample(self, request: pb.SampleRequest, context) -> pb.SampleResponse:
        fields = codec.sample_request_from_proto(request)

        def gone() -> bool:  # the RPC was cancelled, or its client went away
            return not context.is_active()

        decode = partial(requests.SampleRequest, **fields, cancelled=gone)
        return codec.samples_to_proto(
            self._apply(context, ops.SAMPLE, decode, run_id=request.run_id).samples
        )

    def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        texts, special = list(request.texts), request.add_special_tokens
        decode = partial(requests.TokenizeRequest, texts, special)
        token_lists = self._apply(context, ops.TOKENIZE, decode, run_id=request.run_id)
        return pb.TokenizeResponse(token_lists=codec.token_lists_to_proto(token_lists))

    def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        token_lists = codec.token_lists_from_proto(request.token_lists)
        decode = partial(requests.DetokenizeRequest, token_lists)
        return pb.DetokenizeResponse(
            texts=self._apply(context, ops.DETOKENIZE, decode, run_id=request.run_id)
        )

    def SaveState(self, request: pb.SaveStateRequest, context) -> pb.SaveStateResponse:
        op = codec.operation_from_proto(request.operation)
        decode = partial(requests.CheckpointRequest, request.name)
        return codec.save_state_to_proto(
            self._apply(context, ops.SAVE_STATE, decode, op, run_id=request.run_id)
        )

    def LoadState(self, request: pb.LoadStateRequest, context) -> pb.LoadStateResponse:
        op = codec.operation_from_proto(request.operation)
        decode = partial(requests.CheckpointRequest, request.name)
        return codec.load_state_to_proto(
            self._apply(context, ops.LOAD_STATE, decode, op, run_id=request.run_id)
        )

    def LoadWeights(self, request: pb.LoadWeightsRequest, context) -> pb.LoadWeightsResponse:
        op = codec.operation_from_proto(request.operation)

        def decode() -> requests.LoadWeightsRequest:
            return requests.LoadWeightsRequest(codec.weights_source_from_proto(request))

        return codec.load_weights_to_proto(
            self._apply(context, ops.LOAD_WEIGHTS, decode, op, run_id=request.run_id)
        )

    def ExportWeights(
        self, request: pb.ExportWeightsRequest, context
    ) -> Iterator[pb.ExportWeightsResponse]:
        op = codec.operation_from_proto(request.operation)
        decode = partial(requests.ExportWeightsRequest, request.name, request.checkpoint)
        outcome = self._apply(context, ops.EXPORT_WEIGHTS, decode, op, run_id=request.run_id)
        yield codec.export_result_to_proto(outcome)
        if not request.download:
            return
        try:
            for file, offset, data in read_export_files(outcome.directory, outcome.files):
                yield (
                    chunks.encode_chunk(file.path, offset, data)
                    if data
                    else (codec.file_end_to_proto(file))
                )
        except (OSError, InvalidArgument) as error:
            message = f"export {request.name!r} changed on the server; export it again ({error})"
            context.abort(status_code(error), message)

    def Close(self, request: pb.CloseRequest, context) -> pb.CloseResponse:
        def close() -> outcomes.SessionInfo:
            self._guarded(context, RunAccess.check_close, request.run_id)
            return self._own_info(context, self.session_host.close(request.run_id or None))

        info = self._run(context, "Close", "", close)
        return pb.CloseResponse(info=codec.session_info_to_proto(info))


class Undecodable:
    """Request bytes that are no valid message of the method's type (what the decoding
    deserializer hands the handler instead of raising, which grpc would report as INTERNAL)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = (
            f"the request is not a valid {type_name} ({error}); send one built from "
            "protos/trainwire/v1/session.proto"
        )


def _decoding(message_type: Any) -> Callable[[bytes], Any]:
    type_name = message_type.DESCRIPTOR.full_name
    parse = message_type.FromString

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            return Undecodable(type_name, error)

    return deserialize


def _refusing_undecodable(behavior: Callable[..., Any]) -> Callable[..., Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            logger.debug("refused undecodable request: %s", request.message)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behavior(request, context)

    return handle


def add_to_server(servicer: TrainingSessionServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as the generated ``add_..._to_server`` would, except that
    ExportWeights sends its pre-encoded chunks as they are (``chunks.serialize_export_item``)
    and bytes that do not decode are INVALID_ARGUMENT (``Undecodable``), not grpc's INTERNAL."""
    service = pb.DESCRIPTOR.services_by_name["TrainingSessionService"]
    handlers = {}
    for method in service.methods:
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        response = getattr(pb, method.output_type.name)
        handlers[method.name] = make(
            _refusing_undecodable(getattr(servicer, method.name)),
            request_deserializer=_decoding(getattr(pb, method.input_type.name)),
            response_serializer=chunks.serialize_export_item
            if method.name == ops.EXPORT_WEIGHTS.kind
            else response.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
