"""The service's public surface without a server: wire conversions, retries, imports."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys

import grpc
import pytest

from trainwire.client.session.retry import RetryPolicy, call_with_retry, position_from_error
from trainwire.contract import chunks, codec, outcomes
from trainwire.server.service import journal as journal_records
from trainwire.v1 import session_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details="", trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_outcomes_round_trip_through_the_journal_record_and_the_wire():
    files = (outcomes.ExportedFile("model.safetensors", 10, "ab" * 32),)
    outcome = outcomes.ExportOutcome(
        "k", 3, False, "sha256:x", name="e", format="adapter", files=files
    )

    record = journal_records.outcome_record(outcome)
    replayed = journal_records.outcome_from_record(outcomes.ExportOutcome, record, replayed=True)
    decoded = codec.export_outcome_from_proto(codec.export_result_to_proto(replayed).result)

    assert "replayed" not in record and "directory" not in record
    assert decoded == replayed and decoded.replayed and decoded.files == files
    step = outcomes.OptimStepOutcome(
        "k", 2, True, "", step=1, learning_rate=0.1 + 0.2, grad_norm=3.5
    )
    assert codec.optim_step_from_proto(codec.optim_step_to_proto(step)) == step  # doubles exact


def test_a_forward_backward_record_is_the_outcome_as_json_and_round_trips_bit_for_bit():
    """The journal's record is taken field by field (no deep copy on the engine thread): the
    same JSON a deep copy gives, and the same outcome back, every float exact."""
    logprobs = ((-0.1, -2.5e-300, float("-inf")), (0.1 + 0.2,))
    outcome = outcomes.ForwardBackwardOutcome(
        "k", 5, False, "", loss=1 / 3, token_count=4, logprobs=logprobs, metrics={"loss:sum": 2.0}
    )

    record = journal_records.outcome_record(outcome)
    deep = dataclasses.asdict(outcome)
    del deep["replayed"]
    back = journal_records.outcome_from_record(
        outcomes.ForwardBackwardOutcome, json.loads(json.dumps(record))
    )

    assert json.dumps(record, sort_keys=True) == json.dumps(deep, sort_keys=True)
    assert back == outcome and back.logprobs == logprobs
    assert record["metrics"] is not outcome.metrics  # a copy: the entry never changes after


def test_session_info_round_trips_every_state():
    for state in (
        outcomes.IDLE,
        outcomes.RESTORING,
        outcomes.OPEN,
        outcomes.CLOSED,
        outcomes.FAILED,
    ):
        info = outcomes.SessionInfo(run_id="r", position=4, state=state, max_steps=7)
        assert codec.session_info_from_proto(codec.session_info_to_proto(info)) == info


@pytest.mark.parametrize(
    ("path", "offset", "data"),
    [("model.safetensors", 0, b"\x00" * 300), ("sub/é.bin", 3 << 40, bytes(range(256)) * 4099),
     ("", 1, b"x"), ("a", 0, b"")],
)  # fmt: skip
def test_hand_encoded_chunks_are_the_bytes_protobuf_writes_and_decode_without_copies(
    path, offset, data
):
    expected = pb.ExportWeightsResponse(
        chunk=pb.FileChunk(path=path, offset=offset, data=data)
    ).SerializeToString()

    encoded = chunks.encode_chunk(path, offset, data)
    decoded = chunks.decode_export_item(encoded)

    assert encoded == expected
    assert isinstance(decoded, chunks.RawChunk)
    assert (decoded.path, decoded.offset, bytes(decoded.data)) == (path, offset, data)
    assert isinstance(decoded.data, memoryview)


def test_other_export_items_decode_through_protobuf():
    end = pb.ExportWeightsResponse(file_end=pb.FileEnd(path="a", size_bytes=3, sha256="ab"))
    chunk_with_unknown_field_5 = b"\x12\x05" + b"\x0a\x01a" + b"\x28\x01"

    assert chunks.decode_export_item(end.SerializeToString()) == end
    parsed = chunks.decode_export_item(chunk_with_unknown_field_5)
    assert isinstance(parsed, pb.ExportWeightsResponse) and parsed.chunk.path == "a"


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("checkpoint:best", "checkpoint", "best"),
        ("export:final", "export", "final"),
        ("model:base/llama", "model_path", "base/llama"),
        ("base/llama", "model_path", "base/llama"),
    ],
)
def test_weights_sources_are_named_by_prefix(text, kind, value):
    assert outcomes.WeightsSource.parse(text) == outcomes.WeightsSource(kind, value)


def test_only_unavailable_and_deadline_exceeded_are_retried_with_growing_jittered_waits():
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=1.0, max_backoff_s=3.0, jitter=0.5)
    failures = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED]
    waits: list[float] = []

    def flaky():
        if failures:
            raise FakeRpcError(failures.pop(0))
        return "done"

    assert call_with_retry(flaky, policy, sleep=waits.append, rng=lambda: 1.0) == "done"
    assert waits == [0.5, 1.0]  # 1.0 and 2.0, each scaled by (1 - 0.5 * 1.0)
    assert policy.delay_s(5, rng=lambda: 0.0) == 3.0  # capped

    def refused():
        raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT)

    with pytest.raises(FakeRpcError):
        call_with_retry(refused, policy, sleep=waits.append)
    assert len(waits) == 2


def test_the_last_retryable_error_is_raised_as_received():
    error = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")
    calls = []

    def down():
        calls.append(1)
        raise error

    with pytest.raises(FakeRpcError) as raised:
        call_with_retry(down, RetryPolicy(max_attempts=3), sleep=lambda s: None)
    assert raised.value is error and len(calls) == 3


def test_position_from_error_reads_the_trailing_metadata_only():
    code = grpc.StatusCode.FAILED_PRECONDITION
    metadata = (("other", "3"), (codec.POSITION_METADATA_KEY, "12"))
    assert position_from_error(FakeRpcError(code, "", metadata)) == 12
    # The details are for people: a position written there alone is not one.
    details = "expected_position 0, but the session is at position 5 (last operation k)"
    assert position_from_error(FakeRpcError(code, details)) is None
    assert position_from_error(FakeRpcError(code, "no session is open")) is None
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "", metadata)
    assert position_from_error(unavailable) is None


HEAVY = ("torch", "numpy", "transformers")
TORCH_FREE = {
    "client": "from trainwire.client import SessionClient, ManagedTrainingPlan\n"
    "import trainwire.client.control.controller, trainwire.client.control.dispatch\n"
    "import trainwire.contract.codec, trainwire.client.session.retry\n"
    "import trainwire.contract.chunks, trainwire.contract.outcomes",
    "wire": "import trainwire.v1.session_pb2, trainwire.v1.session_pb2_grpc",
    "tiny-data": "from trainwire.testing import tiny_sentiment_examples, tiny_text_examples\n"
    "tiny_sentiment_examples(4), tiny_text_examples(4)",
    "plan-and-inspect": "from trainwire.cli import main\n"
    "assert main(['plan', *sys.argv[1:]]) == 0\n"
    "assert main(['inspect', sys.argv[-1]]) == 0",
}


def heavy_modules_after(code: str, *argv: str) -> list[str]:
    """The heavy packages (torch, numpy, transformers) a fresh Python has loaded after ``code``."""
    report = f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    script = f"import sys\n{code}\n{report}"
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(TORCH_FREE))
def test_the_client_side_never_imports_torch_numpy_or_transformers(case, tmp_path):
    """DESIGN: importing trainwire.client, or running `trainwire plan`, never imports torch."""
    examples, config = tmp_path / "train.jsonl", tmp_path / "config.json"
    examples.write_text("".join(f'{{"text": "text {i}", "label": "b"}}\n' for i in range(5)))
    config.write_text('{"model": "m", "task": "sequence-classification", "labels": ["a", "b"]}')
    argv = ["--examples", str(examples), "--config", str(config), "--output"]
    argv.append(str(tmp_path / "manifest.json"))

    assert heavy_modules_after(TORCH_FREE[case], *argv) == []


def test_the_server_package_imports_torch_only_once_the_engine_is_touched():
    # The probe sees torch when it is there: an empty list above is a real finding.
    assert heavy_modules_after("import trainwire.server") == []
    touched = heavy_modules_after("import trainwire.server\ntrainwire.server.TrainingSession")
    assert "torch" in touched


def test_the_server_package_exports_load_lazily_and_serve_is_callable():
    import trainwire.server
    from trainwire.server import ManagedTraining, SessionHost, TrainingSession, serve
    from trainwire.server.engine.managed import ManagedTraining as ManagedClass
    from trainwire.server.service.host import SessionHost as HostClass

    assert (ManagedTraining, SessionHost) == (ManagedClass, HostClass)
    assert TrainingSession is trainwire.server.TrainingSession
    assert callable(serve)
    with pytest.raises(AttributeError):
        trainwire.server.NoSuchThing  # noqa: B018


def test_the_engine_and_the_host_import_neither_grpc_nor_protobuf():
    """Issue 10: the engine and the plan are plain Python; gRPC is the servicer's business.

    One fresh Python imports each module in turn and reports what is loaded after each: a module
    that imported gRPC alone would show it there, as every module it imports is loaded then."""
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    print(sorted({'grpc', 'grpc_health', 'google.protobuf'} & set(sys.modules)))"
    )
    plain = (
        "trainwire.server.engine.session",
        "trainwire.server.service.host",
        "trainwire.contract.planning.plan",
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *plain, "trainwire.server.grpc.servicer"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    *after_plain, after_servicer = done.stdout.splitlines()
    assert dict(zip(plain, after_plain, strict=True)) == dict.fromkeys(plain, "[]")
    assert "grpc" in after_servicer  # the probe sees grpc when it is there


def test_session_info_carries_the_damaged_checkpoints_over_the_wire():
    info = outcomes.SessionInfo(
        run_id="r", restored_checkpoint="early", damaged_checkpoints=("late",)
    )
    assert codec.session_info_from_proto(codec.session_info_to_proto(info)) == info
