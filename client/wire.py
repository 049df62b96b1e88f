"""The service's results as plain dataclasses, and their conversion to and from the wire.

Both sides share these: the server's session host returns them (and journals them), the servicer
encodes them, and ``SessionClient`` decodes them back into the same classes. torch-free: only the
generated protobuf code is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainwire.client.config import InputExample
from trainwire.v1 import session_pb2 as pb

# Lifecycle names, as SessionInfo.state spells them.
IDLE, RESTORING, OPEN, CLOSED, FAILED = "idle", "restoring", "open", "closed", "failed"
_STATE_TO_PROTO = {
    IDLE: pb.SESSION_STATE_IDLE,
    RESTORING: pb.SESSION_STATE_RESTORING,
    OPEN: pb.SESSION_STATE_OPEN,
    CLOSED: pb.SESSION_STATE_CLOSED,
    FAILED: pb.SESSION_STATE_FAILED,
}
_STATE_FROM_PROTO = {value: name for name, value in _STATE_TO_PROTO.items()}

FORMAT_FULL, FORMAT_ADAPTER = "full", "adapter"
_FORMAT_TO_PROTO = {FORMAT_FULL: pb.EXPORT_FORMAT_FULL, FORMAT_ADAPTER: pb.EXPORT_FORMAT_ADAPTER}
_FORMAT_FROM_PROTO = {value: name for name, value in _FORMAT_TO_PROTO.items()}

POSITION_METADATA_KEY = "trainwire-position"
"""Trailing metadata of a FAILED_PRECONDITION position mismatch: the server's real position."""


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


WEIGHTS_SOURCE_KINDS = ("checkpoint", "export", "model_path")
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


@dataclass(frozen=True)
class OpenOutcome(SessionInfo):
    """The session after ``open``; ``created`` is True when this call created it."""

    created: bool = False


@dataclass(frozen=True)
class Prediction:
    label: str
    scores: tuple[float, ...]


@dataclass(frozen=True)
class ForwardOutcome:
    loss: float
    predictions: tuple[Prediction, ...] = ()


@dataclass(frozen=True)
class OperationOutcome:
    """An applied (or replayed) state-changing operation: where it left the session."""

    operation_key: str
    position: int
    replayed: bool = False
    state_digest: str = ""  # filled on request (include_digest), and always by save_state


@dataclass(frozen=True)
class ForwardBackwardOutcome(OperationOutcome):
    loss: float = 0.0
    token_count: int = 0  # non-padding tokens in the microbatch, for throughput


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


def outcome_record(outcome: OperationOutcome) -> dict[str, Any]:
    """The JSON-able record the journal keeps (without ``replayed`` and ``directory``)."""
    record = dataclasses.asdict(outcome)
    record.pop("replayed")
    record.pop("directory", None)
    if "files" in record:
        record["files"] = [dict(f) for f in record["files"]]
    return record


def outcome_from_record(cls: type[OperationOutcome], record: dict[str, Any], **changes: Any):
    """Rebuild an outcome of class ``cls`` from ``outcome_record``'s dict."""
    values = dict(record, **changes)
    if "files" in values:
        values["files"] = tuple(ExportedFile(**f) for f in values["files"])
    return cls(**values)


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
# (tests compare the two), with one copy to send and none to receive.

_CHUNK_FIELD = b"\x12"  # ExportWeightsResponse.chunk: field 2, length-delimited
_PATH_FIELD, _OFFSET_FIELD, _DATA_FIELD = 0x0A, 0x10, 0x1A  # FileChunk fields 1, 2 and 3


@dataclass(frozen=True)
class RawChunk:
    """A decoded ``FileChunk`` whose ``data`` is a zero-copy view into the received message."""

    path: str
    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(buffer: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def encode_chunk(path: str, offset: int, data: bytes | memoryview) -> bytes:
    """The serialized ``ExportWeightsResponse`` carrying one chunk."""
    name = path.encode()
    inner = bytearray()
    if name:
        inner += bytes([_PATH_FIELD]) + _varint(len(name)) + name
    if offset:
        inner += bytes([_OFFSET_FIELD]) + _varint(offset)
    if data:
        inner += bytes([_DATA_FIELD]) + _varint(len(data))
    header = _CHUNK_FIELD + _varint(len(inner) + len(data)) + inner
    return b"".join((header, data))


def decode_export_item(message: bytes) -> pb.ExportWeightsResponse | RawChunk:
    """A serialized ``ExportWeightsResponse``: chunks as ``RawChunk``, other items parsed."""
    view = memoryview(message)
    if view[:1] == _CHUNK_FIELD:
        length, at = _read_varint(view, 1)
        if at + length == len(view):
            chunk = _decode_chunk_fields(view, at)
            if chunk is not None:
                return chunk
    return pb.ExportWeightsResponse.FromString(message)


def _decode_chunk_fields(view: memoryview, at: int) -> RawChunk | None:
    path, offset, data = "", 0, view[0:0]
    while at < len(view):
        tag = view[at]
        if tag == _OFFSET_FIELD:
            offset, at = _read_varint(view, at + 1)
        elif tag in (_PATH_FIELD, _DATA_FIELD):
            length, at = _read_varint(view, at + 1)
            if tag == _PATH_FIELD:
                path = bytes(view[at : at + length]).decode()
            else:
                data = view[at : at + length]
            at += length
        else:
            return None  # anything unexpected goes through the protobuf runtime
    return RawChunk(path, offset, data)


def serialize_export_item(item: pb.ExportWeightsResponse | bytes) -> bytes:
    """The ExportWeights response serializer: pre-encoded chunks pass through."""
    return item if isinstance(item, bytes) else item.SerializeToString()


def file_end_to_proto(file: ExportedFile) -> pb.ExportWeightsResponse:
    end = pb.FileEnd(path=file.path, size_bytes=file.size_bytes, sha256=file.sha256)
    return pb.ExportWeightsResponse(file_end=end)


def examples_to_proto(examples: Sequence[InputExample]) -> list[pb.Example]:
    return [example_to_proto(example) for example in examples]
