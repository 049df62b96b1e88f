"""The proto codec: the service's domain types (``trainwire.client.outcomes``) to and from the
generated ``trainwire.v1`` messages. The servicer encodes with it and ``SessionClient`` decodes;
nothing else touches protobuf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from trainwire.client.config import InputExample
from trainwire.client.outcomes import (
    CLOSED,
    FAILED,
    FORMAT_ADAPTER,
    FORMAT_FULL,
    IDLE,
    OPEN,
    RESTORING,
    CheckpointOutcome,
    ExportedFile,
    ExportOutcome,
    ForwardBackwardOutcome,
    ForwardOutcome,
    OpenOutcome,
    OperationOutcome,
    OperationSpec,
    OptimStepOutcome,
    Prediction,
    SessionInfo,
    WeightsSource,
)
from trainwire.v1 import session_pb2 as pb

_STATE_TO_PROTO = {
    IDLE: pb.SESSION_STATE_IDLE,
    RESTORING: pb.SESSION_STATE_RESTORING,
    OPEN: pb.SESSION_STATE_OPEN,
    CLOSED: pb.SESSION_STATE_CLOSED,
    FAILED: pb.SESSION_STATE_FAILED,
}
_STATE_FROM_PROTO = {value: name for name, value in _STATE_TO_PROTO.items()}

_FORMAT_TO_PROTO = {FORMAT_FULL: pb.EXPORT_FORMAT_FULL, FORMAT_ADAPTER: pb.EXPORT_FORMAT_ADAPTER}
_FORMAT_FROM_PROTO = {value: name for name, value in _FORMAT_TO_PROTO.items()}

POSITION_METADATA_KEY = "trainwire-position"
"""Trailing metadata of a FAILED_PRECONDITION position mismatch: the server's real position."""


# -- requests --------------------------------------------------------------------------------

_SOURCE_FIELDS = {
    "checkpoint": "checkpoint_name",
    "export": "export_name",
    "model_path": "model_path",
}


def example_to_proto(example: InputExample) -> pb.Example:
    return pb.Example(text=example.text, label=example.label, completion=example.completion)


def examples_from_proto(examples: Iterable[pb.Example]) -> list[InputExample]:
    return [
        InputExample(
            text=e.text,
            label=e.label if e.HasField("label") else None,
            completion=e.completion if e.HasField("completion") else None,
        )
        for e in examples
    ]


def operation_to_proto(spec: OperationSpec) -> pb.Operation:
    return pb.Operation(
        operation_key=spec.key,
        expected_position=spec.expected_position,
        include_digest=spec.include_digest,
    )


def operation_from_proto(operation: pb.Operation) -> OperationSpec:
    expected = operation.expected_position if operation.HasField("expected_position") else None
    return OperationSpec(operation.operation_key, expected, operation.include_digest)


def weights_source_to_proto(source: WeightsSource) -> dict[str, str]:
    """The ``LoadWeightsRequest`` keyword for ``source`` (its oneof field)."""
    return {_SOURCE_FIELDS[source.kind]: source.value}


def weights_source_from_proto(request: pb.LoadWeightsRequest) -> WeightsSource:
    """The one source a request names; ValueError when it names none."""
    which = request.WhichOneof("source")
    if which is None:
        raise ValueError("load_weights: set one source: checkpoint_name, export_name or model_path")
    kind = {v: k for k, v in _SOURCE_FIELDS.items()}[which]
    return WeightsSource(kind, getattr(request, which))


# -- results ---------------------------------------------------------------------------------


def _operation_result(outcome: OperationOutcome) -> pb.OperationResult:
    return pb.OperationResult(
        operation_key=outcome.operation_key,
        position=outcome.position,
        replayed=outcome.replayed,
        state_digest=outcome.state_digest,
    )


def _operation_fields(result: pb.OperationResult) -> dict[str, Any]:
    return {
        "operation_key": result.operation_key,
        "position": result.position,
        "replayed": result.replayed,
        "state_digest": result.state_digest,
    }


def session_info_to_proto(info: SessionInfo) -> pb.SessionInfo:
    values = {f.name: getattr(info, f.name) for f in dataclasses.fields(SessionInfo)}
    values["state"] = _STATE_TO_PROTO[info.state]
    return pb.SessionInfo(**values)


def session_info_from_proto(info: pb.SessionInfo) -> SessionInfo:
    values = {f.name: getattr(info, f.name) for f in dataclasses.fields(SessionInfo)}
    values["state"] = _STATE_FROM_PROTO.get(info.state, "unknown")
    return SessionInfo(**values)


def open_response_to_proto(outcome: OpenOutcome) -> pb.OpenResponse:
    return pb.OpenResponse(info=session_info_to_proto(outcome), created=outcome.created)


def open_outcome_from_proto(response: pb.OpenResponse) -> OpenOutcome:
    info = session_info_from_proto(response.info)
    return OpenOutcome(**dataclasses.asdict(info), created=response.created)


def forward_to_proto(outcome: ForwardOutcome) -> pb.ForwardResponse:
    predictions = [pb.Prediction(label=p.label, scores=p.scores) for p in outcome.predictions]
    return pb.ForwardResponse(loss=outcome.loss, predictions=predictions)


def forward_from_proto(response: pb.ForwardResponse) -> ForwardOutcome:
    predictions = tuple(Prediction(p.label, tuple(p.scores)) for p in response.predictions)
    return ForwardOutcome(response.loss, predictions)


def forward_backward_to_proto(outcome: ForwardBackwardOutcome) -> pb.ForwardBackwardResponse:
    return pb.ForwardBackwardResponse(
        loss=outcome.loss, token_count=outcome.token_count, result=_operation_result(outcome)
    )


def forward_backward_from_proto(response: pb.ForwardBackwardResponse) -> ForwardBackwardOutcome:
    return ForwardBackwardOutcome(
        loss=response.loss, token_count=response.token_count, **_operation_fields(response.result)
    )


def optim_step_to_proto(outcome: OptimStepOutcome) -> pb.OptimStepResponse:
    return pb.OptimStepResponse(
        step=outcome.step,
        learning_rate=outcome.learning_rate,
        grad_norm=outcome.grad_norm,
        result=_operation_result(outcome),
    )


def optim_step_from_proto(response: pb.OptimStepResponse) -> OptimStepOutcome:
    return OptimStepOutcome(
        step=response.step,
        learning_rate=response.learning_rate,
        grad_norm=response.grad_norm,
        **_operation_fields(response.result),
    )


def save_state_to_proto(outcome: CheckpointOutcome) -> pb.SaveStateResponse:
    return pb.SaveStateResponse(
        result=_operation_result(outcome), name=outcome.name, step=outcome.step
    )


def save_state_from_proto(response: pb.SaveStateResponse) -> CheckpointOutcome:
    return CheckpointOutcome(
        name=response.name, step=response.step, **_operation_fields(response.result)
    )


def load_state_to_proto(outcome: CheckpointOutcome) -> pb.LoadStateResponse:
    return pb.LoadStateResponse(result=_operation_result(outcome), step=outcome.step)


def load_state_from_proto(response: pb.LoadStateResponse, name: str) -> CheckpointOutcome:
    return CheckpointOutcome(name=name, step=response.step, **_operation_fields(response.result))


def load_weights_to_proto(outcome: OperationOutcome) -> pb.LoadWeightsResponse:
    return pb.LoadWeightsResponse(result=_operation_result(outcome))


def load_weights_from_proto(response: pb.LoadWeightsResponse) -> OperationOutcome:
    return OperationOutcome(**_operation_fields(response.result))


def export_result_to_proto(outcome: ExportOutcome) -> pb.ExportWeightsResponse:
    files = [
        pb.ExportedFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256)
        for f in outcome.files
    ]
    result = pb.ExportResult(
        result=_operation_result(outcome),
        name=outcome.name,
        format=_FORMAT_TO_PROTO.get(outcome.format, pb.EXPORT_FORMAT_UNSPECIFIED),
        files=files,
    )
    return pb.ExportWeightsResponse(result=result)


def export_outcome_from_proto(result: pb.ExportResult) -> ExportOutcome:
    return ExportOutcome(
        name=result.name,
        format=_FORMAT_FROM_PROTO.get(result.format, "unknown"),
        files=tuple(ExportedFile(f.path, f.size_bytes, f.sha256) for f in result.files),
        **_operation_fields(result.result),
    )


# -- the export stream's chunks, encoded by hand ------------------------------------------------
#
# Building, serializing and parsing a 1 MiB FileChunk through the protobuf runtime copies its bytes
# four times, which halves the download throughput. Chunks are therefore encoded and decoded here,
# to the very bytes ``ExportWeightsResponse(chunk=FileChunk(...)).SerializeToString()`` gives


def file_end_to_proto(file: ExportedFile) -> pb.ExportWeightsResponse:
    end = pb.FileEnd(path=file.path, size_bytes=file.size_bytes, sha256=file.sha256)
    return pb.ExportWeightsResponse(file_end=end)


def examples_to_proto(examples: Sequence[InputExample]) -> list[pb.Example]:
    return [example_to_proto(example) for example in examples]
