"""Issue 15, item 9 and "also seen": what arrives on the wire before any session code runs.

A request without the token is refused before its bytes are parsed (one tokenless 48 MiB
request used to cost the server a gigabyte); bytes that are no protobuf, and a config nested
past the JSON parser's depth, are INVALID_ARGUMENT, never INTERNAL.
"""

from __future__ import annotations

import grpc
import pytest
from fresh_state import fresh_server_info
from service_fixtures import NO_RETRY, connect, running_server

from trainwire.v1 import session_pb2 as pb

TOKEN = "s3cret-token"
SERVICE = "/trainwire.v1.TrainingSessionService/"
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["TrainingSessionService"].methods]
GARBAGE = b"\xff\xff\xff\xff\x0f not a protobuf"


@pytest.fixture(scope="module")
def parsed():
    """Every request the server parsed, by message type: a spy on each ``FromString``."""
    seen: list[str] = []
    originals = {}
    for name in METHODS:
        cls = getattr(pb, f"{name}Request")
        originals[cls] = cls.FromString

        def spy(data, _cls=cls, _parse=cls.FromString):
            seen.append(_cls.__name__)
            return _parse(data)

        cls.FromString = staticmethod(spy)
    yield seen
    for cls, original in originals.items():
        cls.FromString = original


@pytest.fixture(scope="module")
def guarded(parsed, tmp_path_factory, model_root, llama_config):
    """A token-guarded server (started after the spy, so its handlers parse through it)."""
    with running_server(tmp_path_factory.mktemp("wire"), model_root, token=TOKEN) as handle:
        client = connect(handle, token=TOKEN, retry=NO_RETRY)
        client.open("run", llama_config(), max_steps=4)
        yield handle, client
        client.close_channel()


def raw_call(port: int, method: str, payload: bytes, metadata=()) -> grpc.RpcError | bytes:
    """Send ``payload`` as the request bytes of ``method``; the error, or the first reply."""
    with grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        kind = channel.unary_stream if method == "ExportWeights" else channel.unary_unary
        call = kind(
            SERVICE + method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        try:
            reply = call(payload, timeout=30, metadata=metadata)
            return next(iter(reply)) if method == "ExportWeights" else reply
        except grpc.RpcError as error:
            return error


def big_forward_backward(megabytes: int) -> bytes:
    example = pb.Example(text="tiny")
    count = megabytes * 1024 * 1024 // example.ByteSize()
    request = pb.ForwardBackwardRequest(operation=pb.Operation(operation_key="big"))
    request.examples.extend([example] * count)
    return request.SerializeToString()


def test_a_tokenless_request_is_refused_before_its_bytes_are_parsed(guarded, parsed):
    handle, _ = guarded
    before = fresh_server_info(handle)
    parsed.clear()

    refused = raw_call(handle.port, "ForwardBackward", big_forward_backward(16))

    assert isinstance(refused, grpc.RpcError)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    assert parsed == [], "the server parsed a request it was about to refuse"
    assert fresh_server_info(handle) == before


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no-token", "wrong-token"])
def test_garbage_without_the_token_is_unauthenticated(guarded, method, token):
    handle, _ = guarded
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    refused = raw_call(handle.port, method, GARBAGE, metadata)
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()


@pytest.mark.parametrize("method", METHODS)
def test_undecodable_request_bytes_are_invalid_argument(guarded, method):
    handle, _ = guarded
    before = fresh_server_info(handle)
    refused = raw_call(handle.port, method, GARBAGE, (("authorization", f"Bearer {TOKEN}"),))
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
    assert f"not a valid trainwire.v1.{method}Request" in refused.details()
    assert fresh_server_info(handle) == before


def test_a_config_nested_past_the_parsers_depth_is_invalid_argument(guarded):
    _, client = guarded
    deep = '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}"
    request = pb.OpenRequest(run_id="deep", config_json=deep)
    with pytest.raises(grpc.RpcError) as caught:
        client._stub.Open(request, metadata=client._metadata, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "nested too deeply" in caught.value.details()


# -- a model root is required beyond loopback --------------------------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "10.1.2.3:0", "worker-0:0"])
def test_a_server_listening_beyond_loopback_needs_a_model_root(tmp_path, listen, capsys):
    from trainwire.cli import main
    from trainwire.server.process import serve

    with pytest.raises(ValueError, match="--model-root is required"):
        serve(listen=listen, state_dir=tmp_path / "state", device="cpu")
    assert main(["serve", "--listen", listen, "--state-dir", str(tmp_path / "state")]) != 0
    assert "--model-root is required" in capsys.readouterr().err
    assert not (tmp_path / "state").exists(), "a refused start writes nothing"


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:0", "[::1]:0"])
def test_a_loopback_server_may_open_any_local_path(tmp_path, listen, tiny_llama, llama_config):
    import shutil

    from trainwire.client import InputExample, SessionClient
    from trainwire.server.process import serve

    anywhere = tmp_path / "not" / "a" / "model" / "root"
    shutil.copytree(tiny_llama, anywhere)  # outside the tests' model root, and no root given
    handle = serve(listen=listen, state_dir=tmp_path / "state", device="cpu")
    try:
        address = f"{listen.rsplit(':', 1)[0]}:{handle.port}"
        client = SessionClient(address, retry=NO_RETRY, timeout_s=60)
        client.wait_until_serving(timeout_s=60)
        opened = client.open("anywhere", llama_config(model=str(anywhere)), max_steps=1)
        assert opened.created and opened.state == "open"
        trained = client.forward_backward([InputExample("any path")], operation_key="fb")
        assert trained.position == 1
        client.close_channel()
    finally:
        handle.stop(grace=5)


# -- the controller outlasts the longest restart the manifests allow ---------------------------


def test_the_controller_waits_longer_than_kubernetes_takes_to_restart_a_failed_pod(
    statefulset, container
):
    import inspect

    from trainwire.client.control.controller import Controller

    liveness, startup = container["livenessProbe"], container["startupProbe"]
    restart_s = (
        liveness["periodSeconds"] * liveness["failureThreshold"]
        + statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        + startup["periodSeconds"] * startup["failureThreshold"]
    )
    budget = inspect.signature(Controller).parameters["recovery_timeout_s"].default
    assert budget >= restart_s, (
        f"the controller gives up after {budget}s; a restart takes {restart_s}s"
    )
