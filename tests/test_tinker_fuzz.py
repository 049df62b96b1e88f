"""A fuzzer over the Tinker front's routes: JSON bodies whose fields hold hostile values (and
random protobuf bytes for forward_backward) against a live server with a model open. After
every request: no 500, an answer in time, and, if it was refused, the session exactly as before
(its digest hashed afresh: ``fresh_state``).

What gets past validation runs: a training call's seq_id is mostly the model's next one (else a
used one, or no valid seq_id at all; never one ahead, which would wait for its predecessors for
ever), datums are often well formed around hostile numbers, and every request the front accepted
(or refused after it took its seq_id) is polled until it has its answer, which is never a
``server`` failure. A forward that only reads changes nothing either.

``TRAINWIRE_FUZZ_EXAMPLES`` sizes the run as for the gRPC fuzzer (default 40 per test).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fresh_state import fresh_server_info
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb
from tinker_loops import KEY, tinker_server

from trainwire.server.tinker.codec import INPUT_FIELDS
from trainwire.tiny_models import LLAMA_VOCAB_SIZE

EXAMPLES = int(os.environ.get("TRAINWIRE_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=os.environ.get("TRAINWIRE_FUZZ_RANDOM") is None,
)
REFUSALS = {400, 401, 404, 413, 422, 429}
TALLY: collections.Counter[int] = collections.Counter()  # status codes seen
RAN: collections.Counter[str] = collections.Counter()  # "route outcome" of the calls polled
HEADERS = {"X-API-Key": KEY}
SETTLE_S = 120.0  # an accepted call still unanswered after this is a hang, not a slow call

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**400), 2**63, -1, 0]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "..", "../escape", "a/b", "tinker://x/weights/y", "\x00", "é" * 40]),
    st.text(max_size=12),
    st.lists(st.integers(-5, 600), max_size=6),
    st.dictionaries(st.text(max_size=6), st.integers(-3, 3), max_size=3),
)

# The training calls, run in seq_id order per model (asample's seq_id orders nothing).
SEQUENCED = {"optim_step", "save_weights", "load_weights", "save_weights_for_sampler"}
ROUTES: dict[str, tuple[str, ...]] = {
    "session_heartbeat": ("session_id",),
    "create_model": ("session_id", "base_model", "lora_config", "model_seq_id"),
    "get_info": ("model_id",),
    "optim_step": ("model_id", "seq_id", "adam_params", "optimizer_params"),
    "save_weights": ("model_id", "seq_id", "path"),
    "load_weights": ("model_id", "seq_id", "path", "optimizer"),
    "save_weights_for_sampler": ("model_id", "seq_id", "path", "sampling_session_seq_id"),
    "create_sampling_session": ("session_id", "sampling_session_seq_id", "model_path"),
    "asample": (
        "sampling_session_id",
        "seq_id",
        "num_samples",
        "prompt",
        "sampling_params",
        "prompt_logprobs",
    ),
    "retrieve_future": ("request_id",),
}


@pytest.fixture(scope="module")
def front(
    tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path
) -> Iterator[dict[str, Any]]:
    with tinker_server(tmp_path_factory.mktemp("fuzz") / "state", model_root) as handle:
        api = f"{handle.tinker.base_url}/api/v1"
        client = httpx.Client(base_url=api, headers=HEADERS, timeout=60)
        session_id = client.post("/create_session", json={}).json()["session_id"]
        model = {"session_id": session_id, "base_model": "llama", "lora_config": {"rank": 4}}
        model_id = client.post("/create_model", json=model).json()["model_id"]
        sampler = {"session_id": session_id, "sampling_session_seq_id": 0}
        sampling_id = client.post("/create_sampling_session", json=sampler).json()
        valid = {
            "session_id": session_id,
            "model_id": model_id,
            "sampling_session_id": sampling_id["sampling_session_id"],
            # What a well-formed call holds, so that a draw of some valid fields runs.
            "adam_params": {"learning_rate": 1e-3},
            "path": "fuzz",
            "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 3, "seed": 1},
            "prompt_logprobs": True,
        }
        yield {"handle": handle, "client": client, "valid": valid, "next_seq": 1}
        client.close()


def state_of(front: dict[str, Any]) -> Any:
    """The session as ``Info`` tells it, with its digest hashed afresh."""
    return fresh_server_info(front["handle"])


def check(
    front: dict[str, Any], response_of: Any, route: str = "", *, reads_only: bool = False
) -> None:
    """Send, then: no 500; every call the front took runs to an answer that is no ``server``
    failure; a refusal, at once or when the call ran (``user``), and a call that
    ``reads_only`` leave the session as it was."""
    before = state_of(front)
    response = response_of()
    TALLY[response.status_code] += 1
    assert response.status_code != 500, response.text
    assert response.status_code == 200 or response.status_code in REFUSALS, response.text
    answer = "refused"
    if response.status_code == 200:
        request_id = response.json().get("request_id") if is_json(response) else None
        answer = "done"
        if request_id and route != "retrieve_future":
            answer = settle(front, request_id, route)
            RAN[f"{route} {answer}"] += 1
    else:
        assert "detail" in response.json()
    take_turns(front)  # a refused training call may still have taken its seq_id
    if answer != "done" or reads_only:
        assert state_of(front) == before, f"{route} answered {answer} and changed the session"


def is_json(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("application/json")


def settle(front: dict[str, Any], request_id: str, route: str) -> str:
    """Poll ``request_id`` until it is answered (the server holds each poll up to 20 s); its
    answer is a result ("done") or the caller's failure ("user"), never the server's."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        response = front["client"].post("/retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        answer = response.json() if is_json(response) else {}
        if answer.get("type") != "try_again":
            break
        assert time.monotonic() < deadline, f"{route} {request_id} was never answered"
    assert answer.get("category") != "server", f"{route} {request_id}: {answer}"
    return answer.get("category", "done")


def take_turns(front: dict[str, Any]) -> None:
    """Settle every call holding the model's next seq_id, and move past it."""
    model_id = front["valid"]["model_id"]
    while True:
        request_id = f"{model_id}/{front['next_seq']}"
        response = front["client"].post("/retrieve_future", json={"request_id": request_id})
        if response.status_code == 404:
            return
        settle(front, request_id, "seq")
        front["next_seq"] += 1


def seq_ids(next_seq: int) -> st.SearchStrategy[Any]:
    """Mostly the model's next seq_id; else one used before or none a call can take. Never one
    ahead: it would wait for the calls before it, which the fuzzer never sends."""
    used = st.integers(1, next_seq - 1) if next_seq > 1 else st.just(0)
    never = st.sampled_from([0, -1, -(2**70), True, False, 1.5, "1", None, [1], {"a": 1}])
    return st.one_of(st.just(next_seq), st.just(next_seq), st.just(next_seq), used, never)


@st.composite
def bodies(draw: st.DrawFn, valid: dict[str, Any], next_seq: int) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    body = {}
    for name in ROUTES[route]:
        choice = draw(st.sampled_from(["valid", "hostile", "missing"]))
        if name == "seq_id" and route in SEQUENCED and choice != "missing":
            body[name] = draw(seq_ids(next_seq))
        elif choice == "hostile":
            body[name] = draw(HOSTILE)
        elif choice == "valid" and name in valid:
            body[name] = valid[name]
        elif choice == "valid" and name == "seq_id":  # asample's: any, a re-send or not
            body[name] = draw(st.integers(1, 50))
    return route, body


@FUZZ
@given(data=st.data())
def test_json_routes_refuse_hostile_fields_cleanly(front: dict[str, Any], data) -> None:
    route, body = data.draw(bodies(front["valid"], front["next_seq"]))
    check(front, lambda: front["client"].post(f"/{route}", json=body), route)


@FUZZ
@given(
    raw=st.binary(max_size=512),
    encoding=st.sampled_from(["", "zstd", "gzip", "identity"]),
)
def test_forward_backward_refuses_garbage_bytes_cleanly(
    front: dict[str, Any], raw: bytes, encoding: str
) -> None:
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": encoding}
    route = "forward_backward"
    check(front, lambda: front["client"].post(f"/{route}", content=raw, headers=headers), route)


def test_a_non_object_body_is_refused(front: dict[str, Any]) -> None:
    for body in ([1, 2], "text", 3):
        check(front, lambda body=body: front["client"].post("/optim_step", json=body))
    bad_json = {"Content-Type": "application/json"}
    check(front, lambda: front["client"].post("/save_weights", content=b"{", headers=bad_json))


DTYPES = [pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_FLOAT32, 0, 99]


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    tensor = pb.Tensor(dtype=draw(st.sampled_from(DTYPES)))
    values = draw(st.lists(st.integers(-5, 2**31 - 1), max_size=8))
    kind = draw(st.sampled_from(["dense", "sparse"]))
    tensor.shape.extend(draw(st.lists(st.integers(-3, 10**12), max_size=3)))
    if kind == "dense":
        tensor.dense = np.asarray(values, np.int64).tobytes()[: draw(st.integers(0, 80))]
    else:
        tensor.sparse_csr.values = np.asarray(values, np.int64).tobytes()
        crow = draw(st.lists(st.integers(-3, 12), max_size=5))
        tensor.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
        cols = draw(st.lists(st.integers(-3, 10**6), max_size=8))
        tensor.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
    return tensor


def dense(values: list[Any], dtype: Any, proto_dtype: int) -> pb.Tensor:
    array = np.asarray(values, dtype)
    return pb.Tensor(dtype=proto_dtype, shape=[len(values)], dense=array.tobytes())


def hostile_datum(draw: st.DrawFn, datum: pb.Datum) -> None:
    tokens = draw(st.lists(st.integers(-5, 10**6), max_size=6))
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for name in draw(st.lists(st.sampled_from((*INPUT_FIELDS, "mask")), max_size=3)):
        datum.loss_fn_inputs[name].CopyFrom(draw(tensors()))


def runnable_datum(draw: st.DrawFn, datum: pb.Datum) -> None:
    """Tokens in the vocabulary and every input one value per position, the values hostile
    (float32's extremes, NaN, infinities): what gets past the codec, to run."""
    length = draw(st.integers(1, 6))
    ids = st.lists(st.integers(0, LLAMA_VOCAB_SIZE - 1), min_size=length, max_size=length)
    datum.model_input.add().encoded_text.tokens = np.asarray(draw(ids), np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(dense(draw(ids), np.int64, pb.DTYPE_INT64))
    finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
    values_of = st.sampled_from([finite, finite, finite, st.floats(width=32)])  # some non-finite
    for name in draw(st.lists(st.sampled_from(INPUT_FIELDS[1:]), unique=True, max_size=4)):
        values = draw(st.lists(draw(values_of), min_size=length, max_size=length))
        datum.loss_fn_inputs[name].CopyFrom(dense(values, np.float32, pb.DTYPE_FLOAT32))


@st.composite
def forward_backward_requests(draw: st.DrawFn, model_id: str, next_seq: int) -> tuple[bytes, bool]:
    """A serialized request, and whether it only reads (forward_only)."""
    message = pb.ForwardBackwardRequest(
        model_id=draw(st.sampled_from([model_id, model_id, model_id, "nope", ""])),
        seq_id=draw(seq_ids(next_seq).filter(lambda s: type(s) is int and s >= -(2**31))),
        loss_fn=draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "bogus"])),
        forward_only=draw(st.booleans()),
    )
    for _ in range(draw(st.sampled_from([1, 1, 2, 3, 0]))):
        kind = draw(
            st.sampled_from([runnable_datum, runnable_datum, runnable_datum, hostile_datum])
        )
        kind(draw, message.data.add())
    return message.SerializeToString(), message.forward_only


@FUZZ
@given(data=st.data())
def test_forward_backward_refuses_hostile_datums_cleanly(front: dict[str, Any], data) -> None:
    raw, forward_only = data.draw(
        forward_backward_requests(front["valid"]["model_id"], front["next_seq"])
    )
    headers = {"Content-Type": "application/x-protobuf"}
    route = "forward_backward"
    check(
        front,
        lambda: front["client"].post(f"/{route}", content=raw, headers=headers),
        route,
        reads_only=forward_only,
    )


def test_a_body_past_its_bound_is_refused_as_it_arrives(
    front: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainwire.server.tinker import limits

    monkeypatch.setattr(limits, "MAX_JSON_BYTES", 1000)
    body = b'{"session_id": "' + b"x" * 2000 + b'"}'
    # With its Content-Length declared, and chunked (no length: counted as it arrives).
    for route, content in (("/session_heartbeat", body), ("/save_weights", iter([body]))):
        before = state_of(front)
        response = front["client"].post(route, content=content)
        assert response.status_code == 413
        assert "over 1000 bytes" in response.json()["detail"]
        assert state_of(front) == before


@st.composite
def hostile_bodies(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    """Bodies past the routes' shapes: deeply nested JSON, zstd bodies (garbage, or a small body
    that inflates past the bound), and declared lengths past the bound."""
    kind = draw(st.sampled_from(["nested", "zstd-garbage", "zstd-bomb", "declared-huge"]))
    if kind == "nested":
        depth = draw(st.sampled_from([65, 1000, 100_000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return (opener * depth + "1" + closer * depth).encode(), {}
    if kind == "zstd-garbage":
        return draw(st.binary(max_size=256)), {"Content-Encoding": "zstd"}
    if kind == "zstd-bomb":
        return ZSTD_BOMB, {"Content-Encoding": "zstd"}
    return b"{}", {"Content-Length": str(draw(st.integers(2**28, 2**40)))}


def zstd_bomb() -> bytes:
    """Under 64 KiB that inflates past the 256 MiB bound of a forward_backward body."""
    import zstandard

    return zstandard.ZstdCompressor(level=19).compress(b"\0" * (257 << 20))


ZSTD_BOMB = zstd_bomb()
HALF_SENT = b"POST /api/v1/create_session HTTP/1.1\r\nHost: squatter\r\n"


def raw_status(port: int, route: str, declared_length: str) -> int:
    """The status of a request that declares ``declared_length`` bytes and sends none of them."""
    import socket

    head = (
        f"POST /api/v1/{route} HTTP/1.1\r\nHost: fuzz\r\nX-API-Key: {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared_length}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    return int(status_line.split()[1])


@FUZZ
@given(data=st.data())
def test_nested_compressed_and_oversized_bodies_beside_idle_connections_leave_health_answering(
    front: dict[str, Any], data
) -> None:
    """Issue 21: whatever arrives, and while strangers hold half-sent requests open, the answer
    is a refusal (never a 500) and health answers at once."""
    import socket

    handle = front["handle"]
    port = int(handle.tinker.base_url.rsplit(":", 1)[1])
    squatters = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        for sock in squatters:
            sock.sendall(HALF_SENT)
        route = data.draw(st.sampled_from(["forward_backward", "optim_step", "asample"]))
        content, headers = data.draw(hostile_bodies())
        if "Content-Length" in headers:  # httpx will not send a body shorter than declared
            assert raw_status(port, route, headers["Content-Length"]) == 413
        else:
            check(
                front,
                lambda: front["client"].post(f"/{route}", content=content, headers=headers),
                route,
            )
        assert front["client"].get("/healthz", timeout=5).status_code == 200
    finally:
        for sock in squatters:
            sock.close()


def test_the_fuzzer_reached_refusals_and_accepted_calls(front: dict[str, Any]) -> None:
    """Runs after the others: a fuzzer that never got past validation, or whose accepted calls
    never ran, proves little."""
    assert TALLY[200] > 0 and TALLY[400] > 0 and TALLY[404] > 0, TALLY
    assert RAN["forward_backward done"] > 0 and RAN["forward_backward user"] > 0, RAN
    assert sum(n for key, n in RAN.items() if key.startswith(tuple(SEQUENCED))) > 0, RAN
    assert front["handle"].session_host.info().state == "open"  # still serving
