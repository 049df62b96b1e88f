"""The Tinker front bounds every request before it is logged or run, and answers a caller's bad
request with a 4xx that the SDK does not retry, with a message, changing nothing.

Against a real ``trainwire serve`` process's front, over raw HTTP as the SDK sends it: sample
settings past their bounds (alone or as samples × positions), a zstd body that inflates past its
bound, JSON nested past any Tinker request, and sampling values near 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard
from tinker_loops import KEY, tinker_server

from trainwire.server.process import ServerHandle
from trainwire.server.tinker.codec import MAX_BODY_BYTES
from trainwire.server.tinker.request_log import LOG_FILE

HEADERS = {"X-API-Key": KEY}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@dataclass
class Front:
    handle: ServerHandle
    state_dir: Path
    client: httpx.Client
    sampling_session_id: str

    def log_bytes(self) -> bytes:
        """The request log as it stands (it holds every request the front accepted)."""
        return b"".join(path.read_bytes() for path in sorted(self.state_dir.rglob(LOG_FILE)))

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


# -- a zstd body is inflated only up to its bound --------------------------------------------------


def zstd_of_zeros(size: int) -> bytes:
    """``size`` zero bytes, zstd-compressed a MiB at a time (a few KiB, never ``size`` in RAM)."""
    compressor = zstandard.ZstdCompressor().compressobj()
    chunk = bytes(1024 * 1024)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, compressor.flush()])


def test_a_zstd_body_that_inflates_past_its_bound_is_413_not_busy(front: Front) -> None:
    body = zstd_of_zeros(MAX_BODY_BYTES + 1024 * 1024)
    assert len(body) < 64 * 1024
    before = front.log_bytes()
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    response = front.client.post("/forward_backward", content=body, headers=headers)
    assert response.status_code == 413, response.text  # the SDK does not retry it
    assert f"inflates past {MAX_BODY_BYTES} bytes" in response.json()["detail"]
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
