from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_IDLE: _ClassVar[SessionState]
    SESSION_STATE_RESTORING: _ClassVar[SessionState]
    SESSION_STATE_OPEN: _ClassVar[SessionState]
    SESSION_STATE_CLOSED: _ClassVar[SessionState]
    SESSION_STATE_FAILED: _ClassVar[SessionState]

class ExportFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_FORMAT_UNSPECIFIED: _ClassVar[ExportFormat]
    EXPORT_FORMAT_FULL: _ClassVar[ExportFormat]
    EXPORT_FORMAT_ADAPTER: _ClassVar[ExportFormat]
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_IDLE: SessionState
SESSION_STATE_RESTORING: SessionState
SESSION_STATE_OPEN: SessionState
SESSION_STATE_CLOSED: SessionState
SESSION_STATE_FAILED: SessionState
EXPORT_FORMAT_UNSPECIFIED: ExportFormat
EXPORT_FORMAT_FULL: ExportFormat
EXPORT_FORMAT_ADAPTER: ExportFormat

class Example(_message.Message):
    __slots__ = ("text", "label", "completion")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    text: str
    label: str
    completion: str
    def __init__(self, text: _Optional[str] = ..., label: _Optional[str] = ..., completion: _Optional[str] = ...) -> None: ...

class TokenExample(_message.Message):
    __slots__ = ("tokens", "target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_RATIO_MASK_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    sequence_ratio_mask: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., sequence_ratio_mask: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class LossSpec(_message.Message):
    __slots__ = ("loss_fn", "loss_fn_config")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    def __init__(self, loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("operation_key", "expected_position", "include_digest")
    OPERATION_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_POSITION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    operation_key: str
    expected_position: int
    include_digest: bool
    def __init__(self, operation_key: _Optional[str] = ..., expected_position: _Optional[int] = ..., include_digest: _Optional[bool] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("operation_key", "position", "replayed", "state_digest")
    OPERATION_KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    operation_key: str
    position: int
    replayed: bool
    state_digest: str
    def __init__(self, operation_key: _Optional[str] = ..., position: _Optional[int] = ..., replayed: _Optional[bool] = ..., state_digest: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("run_id", "config_fingerprint", "step", "last_operation_key", "state_digest", "position", "restored_checkpoint", "device", "state", "pending_microbatches", "max_steps", "plan_fingerprint", "damaged_checkpoints")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_OPERATION_KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    RESTORED_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PENDING_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_fingerprint: str
    step: int
    last_operation_key: str
    state_digest: str
    position: int
    restored_checkpoint: str
    device: str
    state: SessionState
    pending_microbatches: int
    max_steps: int
    plan_fingerprint: str
    damaged_checkpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., config_fingerprint: _Optional[str] = ..., step: _Optional[int] = ..., last_operation_key: _Optional[str] = ..., state_digest: _Optional[str] = ..., position: _Optional[int] = ..., restored_checkpoint: _Optional[str] = ..., device: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., pending_microbatches: _Optional[int] = ..., max_steps: _Optional[int] = ..., plan_fingerprint: _Optional[str] = ..., damaged_checkpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("run_id", "config_json", "max_steps", "plan_fingerprint")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    max_steps: int
    plan_fingerprint: str
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ..., max_steps: _Optional[int] = ..., plan_fingerprint: _Optional[str] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("info", "created")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    info: SessionInfo
    created: bool
    def __init__(self, info: _Optional[_Union[SessionInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: SessionInfo
    def __init__(self, info: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("examples", "token_examples", "loss", "run_id")
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    examples: _containers.RepeatedCompositeFieldContainer[Example]
    token_examples: _containers.RepeatedCompositeFieldContainer[TokenExample]
    loss: LossSpec
    run_id: str
    def __init__(self, examples: _Optional[_Iterable[_Union[Example, _Mapping]]] = ..., token_examples: _Optional[_Iterable[_Union[TokenExample, _Mapping]]] = ..., loss: _Optional[_Union[LossSpec, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("label", "scores")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    label: str
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, label: _Optional[str] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("loss", "predictions", "logprobs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss: _Optional[float] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("operation", "examples", "token_examples", "loss", "run_id")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    examples: _containers.RepeatedCompositeFieldContainer[Example]
    token_examples: _containers.RepeatedCompositeFieldContainer[TokenExample]
    loss: LossSpec
    run_id: str
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ..., examples: _Optional[_Iterable[_Union[Example, _Mapping]]] = ..., token_examples: _Optional[_Iterable[_Union[TokenExample, _Mapping]]] = ..., loss: _Optional[_Union[LossSpec, _Mapping]] = ..., run_id: _Optional[str] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("loss", "result", "token_count", "logprobs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    result: OperationResult
    token_count: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss: _Optional[float] = ..., result: _Optional[_Union[OperationResult, _Mapping]] = ..., token_count: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("operation", "learning_rate", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm", "run_id")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    max_grad_norm: float
    run_id: str
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ..., learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., run_id: _Optional[str] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "learning_rate", "grad_norm", "result")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    step: int
    learning_rate: float
    grad_norm: float
    result: OperationResult
    def __init__(self, step: _Optional[int] = ..., learning_rate: _Optional[float] = ..., grad_norm: _Optional[float] = ..., result: _Optional[_Union[OperationResult, _Mapping]] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("operation", "name", "run_id")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    name: str
    run_id: str
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ..., name: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class SaveStateResponse(_message.Message):
    __slots__ = ("result", "name", "step")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    result: OperationResult
    name: str
    step: int
    def __init__(self, result: _Optional[_Union[OperationResult, _Mapping]] = ..., name: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("operation", "name", "run_id")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    name: str
    run_id: str
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ..., name: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class LoadStateResponse(_message.Message):
    __slots__ = ("result", "step")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    result: OperationResult
    step: int
    def __init__(self, result: _Optional[_Union[OperationResult, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("operation", "checkpoint_name", "export_name", "model_path", "run_id")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_NAME_FIELD_NUMBER: _ClassVar[int]
    EXPORT_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    checkpoint_name: str
    export_name: str
    model_path: str
    run_id: str
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ..., checkpoint_name: _Optional[str] = ..., export_name: _Optional[str] = ..., model_path: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: OperationResult
    def __init__(self, result: _Optional[_Union[OperationResult, _Mapping]] = ...) -> None: ...

class ExportWeightsRequest(_message.Message):
    __slots__ = ("operation", "name", "download", "checkpoint", "run_id")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    operation: Operation
    name: str
    download: bool
    checkpoint: str
    run_id: str
    def __init__(self, operation: _Optional[_Union[Operation, _Mapping]] = ..., name: _Optional[str] = ..., download: _Optional[bool] = ..., checkpoint: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class ExportedFile(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ExportResult(_message.Message):
    __slots__ = ("result", "name", "format", "files")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    result: OperationResult
    name: str
    format: ExportFormat
    files: _containers.RepeatedCompositeFieldContainer[ExportedFile]
    def __init__(self, result: _Optional[_Union[OperationResult, _Mapping]] = ..., name: _Optional[str] = ..., format: _Optional[_Union[ExportFormat, str]] = ..., files: _Optional[_Iterable[_Union[ExportedFile, _Mapping]]] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class FileEnd(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ExportWeightsResponse(_message.Message):
    __slots__ = ("result", "chunk", "file_end")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FILE_END_FIELD_NUMBER: _ClassVar[int]
    result: ExportResult
    chunk: FileChunk
    file_end: FileEnd
    def __init__(self, result: _Optional[_Union[ExportResult, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ..., file_end: _Optional[_Union[FileEnd, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: SessionInfo
    def __init__(self, info: _Optional[_Union[SessionInfo, _Mapping]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("prompt_tokens", "max_tokens", "num_samples", "temperature", "top_p", "top_k", "stop_tokens", "seed", "stop_strings", "run_id")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    num_samples: int
    temperature: float
    top_p: float
    top_k: int
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    run_id: str
    def __init__(self, prompt_tokens: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., num_samples: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ..., run_id: _Optional[str] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    def __init__(self, samples: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "add_special_tokens", "run_id")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    run_id: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ..., run_id: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_lists",)
    TOKEN_LISTS_FIELD_NUMBER: _ClassVar[int]
    token_lists: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, token_lists: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_lists", "run_id")
    TOKEN_LISTS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    token_lists: _containers.RepeatedCompositeFieldContainer[TokenIds]
    run_id: str
    def __init__(self, token_lists: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., run_id: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...
