"""The proto codec: the service's domain types (``trainwire.contract.outcomes``) to and from the
generated ``trainwire.v1`` messages. The servicer encodes with it and ``SessionClient`` decodes;
nothing else touches protobuf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from trainwire.contract.config import InputExample
from trainwire.contract.outcomes import (
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
    Sample,
    SessionInfo,
    WeightsSource,
)
from trainwire.contract.tokens import DEFAULT_LOSS, Examples, TokenExample, is_token_batch
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
    values["damaged_checkpoints"] = tuple(info.damaged_checkpoints)
    return SessionInfo(**values)


def open_response_to_proto(outcome: OpenOutcome) -> pb.OpenResponse:
    return pb.OpenResponse(info=session_info_to_proto(outcome), created=outcome.created)


def open_outcome_from_proto(response: pb.OpenResponse) -> OpenOutcome:
    info = session_info_from_proto(response.info)
    return OpenOutcome.from_info(info, created=response.created)


def forward_to_proto(outcome: ForwardOutcome) -> pb.ForwardResponse:
    predictions = [pb.Prediction(label=p.label, scores=p.scores) for p in outcome.predictions]
    return pb.ForwardResponse(
        loss=outcome.loss,
        predictions=predictions,
        logprobs=_logprobs_to_proto(outcome.logprobs),
        metrics=outcome.metrics,
    )


def forward_from_proto(response: pb.ForwardResponse) -> ForwardOutcome:
    predictions = tuple(Prediction(p.label, tuple(p.scores)) for p in response.predictions)
    return ForwardOutcome(
        response.loss,
        predictions,
        logprobs=_logprobs_from_proto(response.logprobs),
        metrics=dict(response.metrics),
    )


def forward_backward_to_proto(outcome: ForwardBackwardOutcome) -> pb.ForwardBackwardResponse:
    return pb.ForwardBackwardResponse(
        loss=outcome.loss,
        token_count=outcome.token_count,
        result=_operation_result(outcome),
        logprobs=_logprobs_to_proto(outcome.logprobs),
        metrics=outcome.metrics,
    )


def forward_backward_from_proto(response: pb.ForwardBackwardResponse) -> ForwardBackwardOutcome:
    return ForwardBackwardOutcome(
        loss=response.loss,
        token_count=response.token_count,
        logprobs=_logprobs_from_proto(response.logprobs),
        metrics=dict(response.metrics),
        **_operation_fields(response.result),
    )


def _logprobs_to_proto(logprobs: Sequence[Sequence[float]]) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(values=row) for row in logprobs]


def _logprobs_from_proto(rows: Iterable[pb.TokenLogprobs]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(row.values) for row in rows)


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


# -- token examples, losses, sampling ------------------------------------------------------------


def token_examples_to_proto(examples: Sequence[TokenExample]) -> list[pb.TokenExample]:
    return [
        pb.TokenExample(
            tokens=e.tokens,
            target_tokens=e.target_tokens,
            weights=e.weights or (),
            logprobs=e.logprobs or (),
            advantages=e.advantages or (),
            sequence_ratio_mask=e.sequence_ratio_mask or (),
        )
        for e in examples
    ]


def token_examples_from_proto(examples: Iterable[pb.TokenExample]) -> list[TokenExample]:
    """Decoded and validated; ValueError names the example. An empty float field is "not
    given" (an example holds at least one position, so it cannot mean zero values)."""
    out = []
    for index, e in enumerate(examples):
        try:
            out.append(
                TokenExample(
                    tuple(e.tokens),
                    tuple(e.target_tokens),
                    weights=tuple(e.weights) or None,
                    logprobs=tuple(e.logprobs) or None,
                    advantages=tuple(e.advantages) or None,
                    sequence_ratio_mask=tuple(e.sequence_ratio_mask) or None,
                )
            )
        except ValueError as error:
            raise ValueError(f"token example {index}: {error}") from None
    return out


def loss_spec_to_proto(loss_fn: str, loss_fn_config: Mapping[str, float] | None) -> pb.LossSpec:
    return pb.LossSpec(loss_fn=loss_fn, loss_fn_config=dict(loss_fn_config or {}))


def loss_spec_from_proto(spec: pb.LossSpec) -> tuple[str, dict[str, float]]:
    """(loss name, config); an empty name is the default, cross_entropy."""
    return spec.loss_fn or DEFAULT_LOSS, dict(spec.loss_fn_config)


def sample_request_to_proto(prompt_tokens: Sequence[int], **params: Any) -> pb.SampleRequest:
    return pb.SampleRequest(
        prompt_tokens=list(prompt_tokens),
        max_tokens=params["max_tokens"],
        num_samples=params["num_samples"],
        temperature=params["temperature"],
        top_p=params["top_p"],
        top_k=params["top_k"],
        stop_tokens=list(params["stop_tokens"]),
        seed=params["seed"],
        stop_strings=list(params.get("stop_strings", ())),
    )


def sample_request_from_proto(request: pb.SampleRequest) -> dict[str, Any]:
    """The engine's ``sample`` keywords; proto3 defaults mean the engine's defaults."""
    return {
        "prompt_tokens": list(request.prompt_tokens),
        "max_tokens": request.max_tokens,
        "num_samples": request.num_samples or 1,
        "temperature": request.temperature if request.HasField("temperature") else 1.0,
        "top_p": request.top_p if request.HasField("top_p") else 1.0,
        "top_k": request.top_k,
        "stop_tokens": tuple(request.stop_tokens),
        "seed": request.seed,
        "stop_strings": tuple(request.stop_strings),
    }


def samples_to_proto(samples: Sequence[Sample]) -> pb.SampleResponse:
    return pb.SampleResponse(
        samples=[
            pb.SampledSequence(tokens=s.tokens, logprobs=s.logprobs, stop_reason=s.stop_reason)
            for s in samples
        ]
    )


def samples_from_proto(response: pb.SampleResponse) -> list[Sample]:
    return [Sample(tuple(s.tokens), tuple(s.logprobs), s.stop_reason) for s in response.samples]


def token_lists_to_proto(token_lists: Iterable[Sequence[int]]) -> list[pb.TokenIds]:
    return [pb.TokenIds(ids=list(ids)) for ids in token_lists]


def token_lists_from_proto(token_lists: Iterable[pb.TokenIds]) -> list[list[int]]:
    return [list(ids.ids) for ids in token_lists]


def add_examples(
    request: pb.ForwardRequest | pb.ForwardBackwardRequest, examples: Examples
) -> None:
    """Text examples or token examples into ``request``: a batch holds one kind."""
    if is_token_batch(examples):
        request.token_examples.extend(token_examples_to_proto(examples))
    else:
        request.examples.extend(examples_to_proto(examples))
