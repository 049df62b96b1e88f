"""The Tinker front bounds every request before it is logged or run, and answers a caller's bad
request with a 4xx that the SDK does not retry, with a message, changing nothing.

Against a real ``trainwire serve`` process's front, over raw HTTP as the SDK sends it: sample
settings past their bounds (alone or as samples × positions), a zstd body that inflates past its
bound, JSON nested past any Tinker request, and sampling values near 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard
from ledger_files import opened_store
from tinker_loops import KEY, tinker_server

from trainwire.server.engine.sampling.params import SamplingLimits
from trainwire.server.process import ServerHandle
from trainwire.server.service.request_records import Record, SampleRecord
from trainwire.server.service.request_store import read_records
from trainwire.server.tinker import app, sample_codec
from trainwire.server.tinker.codec import INFLATE_CHUNK_BYTES, MAX_FORWARD_BACKWARD_BYTES

HEADERS = {"X-API-Key": KEY}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@dataclass
class Front:
    handle: ServerHandle
    state_dir: Path
    client: httpx.Client
    sampling_session_id: str

    def log_bytes(self) -> list[Record]:
        """The request store as it stands (it holds every request the front accepted)."""
        return read_records(self.state_dir)

    def sample(self, number: int, **settings: Any) -> httpx.Response:
        """An asample with seq_id ``number``, a short prompt and 4 tokens, unless ``settings``
        say otherwise."""
        params = {"max_tokens": 4, "seed": 3, **settings.pop("sampling_params", {})}
        body = {
            "sampling_session_id": self.sampling_session_id,
            "seq_id": number,
            "num_samples": 1,
            "prompt": PROMPT,
            "sampling_params": params,
            **settings,
        }
        return self.client.post("/asample", json=body)

    def result(self, request_id: str) -> httpx.Response:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            response = self.client.post("/retrieve_future", json={"request_id": request_id})
            if not response.headers["content-type"].startswith("application/json"):
                return response
            if response.json().get("type") != "try_again":
                return response
        raise AssertionError(f"no result for {request_id}")


@contextlib.contextmanager
def start(state_dir: Path, model_root: Path) -> Iterator[Front]:
    """A server with a model open and a sampling session on it."""
    with tinker_server(state_dir, model_root) as handle:
        client = httpx.Client(
            base_url=f"{handle.tinker.base_url}/api/v1", headers=HEADERS, timeout=60
        )
        session_id = client.post("/create_session", json={}).json()["session_id"]
        model = {"session_id": session_id, "base_model": "llama", "lora_config": {"rank": 4}}
        assert client.post("/create_model", json=model).status_code == 200
        sampler = {"session_id": session_id, "sampling_session_seq_id": 0}
        sampling = client.post("/create_sampling_session", json=sampler).json()
        yield Front(handle, state_dir, client, sampling["sampling_session_id"])
        client.close()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path):
    with start(tmp_path_factory.mktemp("bounds") / "state", model_root) as started:
        yield started


def long_prompt(tokens: int) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": [5] * tokens}]}


# -- every sample setting, and samples x positions, bounded before the request is logged -----------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_samples": 10**12}, "num_samples must be in [1, 64], got 1000000000000"),
        ({"num_samples": 65}, "num_samples must be in [1, 64]"),
        ({"num_samples": 0}, "num_samples must be in [1, 64]"),
        ({"sampling_params": {"max_tokens": 10**9}}, "max_tokens must be in [1, 4096]"),
        ({"sampling_params": {"top_k": -7}}, "top_k must be in [-1, 2147483647]"),
        ({"sampling_params": {"seed": -1}}, "seed must be in [0, 9223372036854775807]"),
        ({"sampling_params": {"seed": 2**70}}, "seed must be in [0, 9223372036854775807]"),
        ({"sampling_params": {"temperature": -0.5}}, "temperature must be >= 0"),
        # the SDK writes a NaN or an infinity as null: refused, never read as the default
        (
            {"sampling_params": {"temperature": None}},
            "temperature must be a finite number, got null",
        ),
        ({"sampling_params": {"top_p": None}}, "top_p must be a finite number, got null"),
        ({"sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"sampling_params": {"stop": [7] * 1025}}, "1025 stop tokens; at most 1024"),
        ({"sampling_params": {"stop": [2**40]}}, "stop must hold token ids in [0, 2147483647]"),
        ({"prompt": long_prompt(32769)}, "the prompt has 32769 tokens; at most 32768"),
        ({"prompt": {"chunks": []}}, "the prompt holds no tokens"),
        ({"seq_id": -1}, "seq_id must be in [0, 9223372036854775807]"),
        # each count within its bound, their product (what decoding holds) is not
        (
            {"num_samples": 64, "prompt": long_prompt(32768)},
            "num_samples 64 x (prompt 32768 + max_tokens 4) is 2097408 token positions at once",
        ),
        (
            {"num_samples": 64, "prompt": long_prompt(60), "sampling_params": {"max_tokens": 4096}},
            "at most 262144",
        ),
    ],
)
def test_an_asample_past_a_bound_is_a_400_and_is_never_logged(
    front: Front, settings: dict[str, Any], message: str
) -> None:
    before = front.log_bytes()
    response = front.sample(1000, **settings)
    assert response.status_code == 400, response.text
    assert message in response.json()["detail"]
    assert front.log_bytes() == before


def test_the_fronts_sample_bounds_are_the_engines() -> None:
    """The front checks the engine's limits before it logs a request (it cannot import them)."""
    front = {
        "max_samples": sample_codec.MAX_SAMPLES,
        "max_tokens": sample_codec.MAX_SAMPLE_TOKENS,
        "max_prompt_tokens": sample_codec.MAX_PROMPT_TOKENS,
        "max_sample_positions": sample_codec.MAX_SAMPLE_POSITIONS,
        "max_stop_tokens": sample_codec.MAX_STOP_TOKENS,
    }
    limits = SamplingLimits()
    assert {name: getattr(limits, name) for name in front} == front


def test_an_asample_at_the_bounds_is_served(front: Front) -> None:
    prompt = long_prompt(60)  # 64 x (60 + 4) positions: within 262144, and the tiny model's 256
    response = front.sample(1001, num_samples=64, prompt=prompt)
    assert response.status_code == 200, response.text
    assert len(response.json()["sample_sequence_ids"]) == 64
    assert front.result(response.json()["request_id"]).status_code == 200


def test_a_logged_asample_past_its_bounds_does_not_keep_the_server_from_starting(
    tmp_path: Path, model_root: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request an older server accepted and logged: read back at start, it is refused again
    by its bounds (its 10**12 sample ids are never built), and the server serves."""
    state_dir = tmp_path / "state"
    with start(state_dir, model_root) as first:
        sampling_session_id = first.sampling_session_id
    body = {
        "sampling_session_id": sampling_session_id,
        "seq_id": 7,
        "num_samples": 10**12,
        "prompt": PROMPT,
        "sampling_params": {"max_tokens": 4},
    }
    with opened_store(state_dir) as log:
        log.write(SampleRecord(f"{sampling_session_id}/7", body))
    caplog.set_level(logging.INFO, logger="trainwire.server.tinker")
    with tinker_server(state_dir, model_root) as handle:
        healthz = f"{handle.tinker.base_url}/api/v1/healthz"
        deadline = time.monotonic() + 60
        while httpx.get(healthz, headers=HEADERS, timeout=60).status_code != 200:
            assert time.monotonic() < deadline, "the server never served again"
            time.sleep(0.1)
        assert handle.session_host.info().state == "open"
    refusal = "num_samples must be in [1, 64], got 1000000000000"
    assert any(refusal in record.getMessage() for record in caplog.records)


# -- a zstd body is inflated only up to its bound --------------------------------------------------


def zstd_of_zeros(size: int) -> bytes:
    """``size`` zero bytes, zstd-compressed a MiB at a time (a few KiB, never ``size`` in RAM)."""
    compressor = zstandard.ZstdCompressor().compressobj()
    chunk = bytes(1024 * 1024)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, compressor.flush()])


def test_a_zstd_body_that_inflates_past_its_bound_is_413_not_busy(front: Front) -> None:
    body = zstd_of_zeros(MAX_FORWARD_BACKWARD_BYTES + 1024 * 1024)
    assert len(body) < 64 * 1024
    before = front.log_bytes()
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    response = front.client.post("/forward_backward", content=body, headers=headers)
    assert response.status_code == 413, response.text  # the SDK does not retry it
    assert f"inflates past {MAX_FORWARD_BACKWARD_BYTES} bytes" in response.json()["detail"]
    assert front.log_bytes() == before


def test_zstd_bodies_sent_at_once_inflate_a_few_at_a_time(front: Front) -> None:
    """Eight bombs sent together: at most ``MAX_DECODING`` inflate at a time, each stopped at
    the route's bound, so the process never holds more than that many bounds of them."""
    body = zstd_of_zeros(2 * MAX_FORWARD_BACKWARD_BYTES)
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    statuses: list[int] = []

    def send() -> None:
        statuses.append(
            front.client.post("/forward_backward", content=body, headers=headers).status_code
        )

    senders = [threading.Thread(target=send) for _ in range(8)]
    tracemalloc.start()
    try:
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join(120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert statuses == [413] * 8
    # Each inflating body grows in place (up to an eighth over its bound) beside one read chunk.
    per_body = MAX_FORWARD_BACKWARD_BYTES * 9 // 8 + 2 * INFLATE_CHUNK_BYTES
    assert peak <= app.MAX_DECODING * per_body + 16 * 1024 * 1024, peak


def test_a_json_route_refuses_a_compressed_body_unread(front: Front) -> None:
    """Only forward_backward inflates a body; a JSON route says so instead of parsing bytes."""
    before = front.log_bytes()
    headers = {"Content-Type": "application/json", "Content-Encoding": "zstd"}
    body = zstd_of_zeros(64 * 1024 * 1024)
    for route in ("optim_step", "asample", "create_model"):
        response = front.client.post(f"/{route}", content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert "Content-Encoding 'zstd' is only for forward_backward" in response.json()["detail"]
    assert front.log_bytes() == before


# -- JSON nested past any Tinker request -----------------------------------------------------------

DEEP = 100_000


@pytest.mark.parametrize(
    "route",
    ["optim_step", "asample", "create_model", "retrieve_future", "session_heartbeat", "get_info"],
)
@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        b"[" * DEEP + b"]" * DEEP,
        b'{"a": ' + b'{"b": ' * 200 + b"1" + b"}" * 200 + b"}",  # parses, still far too deep
    ],
    ids=["object-100000", "list-100000", "object-200"],
)
def test_deeply_nested_json_is_a_400_with_a_message(front: Front, route: str, raw: bytes) -> None:
    before = front.log_bytes()
    headers = {"Content-Type": "application/json"}
    response = front.client.post(f"/{route}", content=raw, headers=headers)
    assert response.status_code == 400, response.text
    assert "nests more than 64 levels deep" in response.json()["detail"]
    assert front.log_bytes() == before


# -- sampling values near 0, through the Tinker front ----------------------------------------------


def test_a_temperature_or_top_p_near_zero_samples_what_greedy_does(front: Front) -> None:
    """Answered with the samples (the same bytes as greedy's), never a ``server`` failure."""
    greedy = front.sample(2000, sampling_params={"temperature": 0})
    expected = front.result(greedy.json()["request_id"])
    assert expected.headers["content-type"] == "application/x-protobuf"
    for seq_id, params in enumerate(({"temperature": 1e-300}, {"top_p": 5e-324}), 2001):
        response = front.sample(seq_id, sampling_params=params)
        assert response.status_code == 200, response.text
        assert front.result(response.json()["request_id"]).content == expected.content
