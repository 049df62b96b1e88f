"""The servicer in isolation (grpc-testing): decoding, encoding, status codes, the export stream."""

from __future__ import annotations

import hashlib

import grpc
import grpc_testing
import pytest

from trainwire.client import InputExample
from trainwire.contract import codec, outcomes
from trainwire.server.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PositionMismatch,
    ResourceExhausted,
    Unavailable,
)
from trainwire.server.grpc.servicer import TrainingSessionServicer
from trainwire.server.service import operations as ops
from trainwire.server.service.state_dir import list_export_files
from trainwire.v1 import session_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["TrainingSessionService"]
MiB = 1 << 20


class FakeHost:
    """Records what the servicer passed; answers with ``reply`` or raises ``error``."""

    def __init__(self, reply=None, error: BaseException | None = None) -> None:
        self.reply, self.error, self.calls = reply, error, []

    def __getattr__(self, name):
        def method(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if self.error is not None:
                raise self.error
            return self.reply

        return method


def invoke(host, method: str, request, metadata=()):
    server = grpc_testing.server_from_dictionary(
        {SERVICE: TrainingSessionServicer(host)}, grpc_testing.strict_real_time()
    )
    rpc = server.invoke_unary_unary(SERVICE.methods_by_name[method], metadata, request, None)
    return rpc.termination()  # (response, trailing metadata, code, details)


def test_forward_backward_decodes_examples_and_the_operation():
    outcome = outcomes.ForwardBackwardOutcome("k", 3, False, "sha256:x", loss=0.25)
    host = FakeHost(outcome)
    request = pb.ForwardBackwardRequest(
        operation=pb.Operation(operation_key="k", expected_position=2, include_digest=True),
        examples=[pb.Example(text="a"), pb.Example(text="b", completion=" c")],
    )

    response, _, code, _ = invoke(host, "ForwardBackward", request)

    assert code == grpc.StatusCode.OK
    assert codec.forward_backward_from_proto(response) == outcome
    ((name, (operation, request, op), _),) = host.calls
    assert (name, operation) == ("apply", ops.FORWARD_BACKWARD)
    assert request.examples == [InputExample("a"), InputExample("b", completion=" c")]
    assert op == outcomes.OperationSpec("k", 2, True)
    assert (request.loss_fn, request.loss_fn_config) == ("cross_entropy", {})


def test_an_absent_expected_position_stays_absent():
    host = FakeHost(outcomes.OptimStepOutcome("k", 1, step=1))

    invoke(host, "OptimStep", pb.OptimStepRequest(operation=pb.Operation(operation_key="k")))

    assert host.calls[0][1][2] == outcomes.OperationSpec("k", None, False)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (FailedPrecondition("state"), grpc.StatusCode.FAILED_PRECONDITION),
        (NotFound("gone"), grpc.StatusCode.NOT_FOUND),
        (AlreadyExists("twice"), grpc.StatusCode.ALREADY_EXISTS),
        (ResourceExhausted("oom"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unavailable("later"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_map_to_status_codes_in_one_place(error, code):
    request = pb.SaveStateRequest(operation=pb.Operation(operation_key="k"), name="c")

    _, _, got, details = invoke(FakeHost(error=error), "SaveState", request)

    assert (got, details) == (code, str(error))


def test_a_position_mismatch_is_failed_precondition_naming_the_real_position():
    # The trailing `trainwire-position` metadata is checked on a real server: grpc-testing's
    # abort drops trailing metadata.
    error = PositionMismatch("expected 3, but the session is at position 7", 7)
    request = pb.OptimStepRequest(operation=pb.Operation(operation_key="k", expected_position=3))

    _, _, code, details = invoke(FakeHost(error=error), "OptimStep", request)

    assert code == grpc.StatusCode.FAILED_PRECONDITION and "at position 7" in details


def test_load_weights_needs_exactly_one_source():
    host = FakeHost(outcomes.OperationOutcome("k", 1))
    bare = pb.LoadWeightsRequest(operation=pb.Operation(operation_key="k"))

    _, _, code, details = invoke(host, "LoadWeights", bare)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "set one source" in details

    invoke(host, "LoadWeights", pb.LoadWeightsRequest(export_name="e"))
    assert host.calls[-1][1][1].source == outcomes.WeightsSource("export", "e")


def test_info_before_open_reports_idle():
    host = FakeHost(outcomes.SessionInfo(device="cpu"))

    response, _, code, _ = invoke(host, "Info", pb.InfoRequest())

    assert code == grpc.StatusCode.OK
    assert response.info.state == pb.SESSION_STATE_IDLE and response.info.device == "cpu"


def test_export_streams_the_result_then_each_file_in_chunks_of_at_most_one_mib(tmp_path):
    export = tmp_path / "export"
    (export / "sub").mkdir(parents=True)
    big = bytes(range(256)) * (5 * MiB // 512)  # 2.5 MiB
    (export / "model.safetensors").write_bytes(big)
    (export / "sub" / "empty.txt").write_bytes(b"")
    files = list_export_files(export)
    outcome = outcomes.ExportOutcome("k", 4, name="e", format="full", files=files, directory=export)
    server = grpc_testing.server_from_dictionary(
        {SERVICE: TrainingSessionServicer(FakeHost(outcome))}, grpc_testing.strict_real_time()
    )
    request = pb.ExportWeightsRequest(
        operation=pb.Operation(operation_key="k"), name="e", download=True
    )

    rpc = server.invoke_unary_stream(SERVICE.methods_by_name["ExportWeights"], (), request, None)
    items = []
    while True:
        try:
            item = rpc.take_response()
        except ValueError:  # grpc-testing: no more responses
            break
        # Chunks leave the servicer pre-encoded; they must parse as the proto says.
        items.append(pb.ExportWeightsResponse.FromString(item) if isinstance(item, bytes) else item)
    _, code, _ = rpc.termination()

    assert code == grpc.StatusCode.OK
    kinds = [item.WhichOneof("item") for item in items]
    assert kinds == ["result", "chunk", "chunk", "chunk", "file_end", "file_end"]
    assert codec.export_outcome_from_proto(items[0].result).files == files
    chunks = [item.chunk for item in items if item.HasField("chunk")]
    assert all(len(chunk.data) <= MiB for chunk in chunks)
    assert [chunk.offset for chunk in chunks] == [0, MiB, 2 * MiB]
    assert b"".join(chunk.data for chunk in chunks) == big
    assert items[4].file_end.sha256 == hashlib.sha256(big).hexdigest()
    assert items[5].file_end.path == "sub/empty.txt" and items[5].file_end.size_bytes == 0
