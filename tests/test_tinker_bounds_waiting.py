"""What waits for its turn on the Tinker front is bounded by the memory its decoded requests hold,
per model and in all (samples included), from acceptance until the call has run.

A review sent 30 maximal forward_backwards in order behind one running call: all were taken
(the bound counted wire bytes, a fifth or less of what the decoded datums hold, and stopped
counting a call once it left the queue), and the process grew 3.2 GB. Here, scaled down: calls
of 4,096 positions behind a forward_backward the engine is held in, with the bound at six calls'
worth of what decoding one really holds (measured). Against a real server in process, over raw
HTTP as the SDK sends it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from test_tinker_bounds_decoding import decoded_bytes
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker_loops import KEY, RawFront, tinker_server

from trainwire.server.process import ServerHandle
from trainwire.server.service import scheduler
from trainwire.server.service.request_records import CallRecord
from trainwire.server.service.request_store import read_records
from trainwire.server.tinker import codec
from trainwire.server.tinker.codec import parse_forward_backward

DATUMS, DATUM_TOKENS = 32, 128  # 4,096 positions a call, each datum within the model's 256
BUDGET_CALLS = 6  # the bound, in calls of what one decoded call really holds
HEADERS = {"X-API-Key": KEY}


def forward_backward_body(model_id: str, seq_id: int) -> bytes:
    """An SDK body (int64 targets, float32 weights) whose ids are past the small ints Python
    shares, so each decoded id is an object of its own, as in a real vocabulary."""
    ids = np.random.default_rng(seq_id).integers(257, 500, size=(DATUMS, DATUM_TOKENS + 1))
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:].tolist(), "weights": [0.5] * DATUM_TOKENS},
        )
        for row in ids
    ]
    request = types.ForwardBackwardRequest(
        types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id, seq_id
    )
    return forward_backward_request_to_proto(request).SerializeToString()


class Front:
    """A server's front with a model open and a sampling client on it."""

    def __init__(self, handle: ServerHandle, state_dir: Path) -> None:
        self.handle, self.state_dir, self.api = handle, state_dir, RawFront(handle.tinker.base_url)
        session_id, self.model_id = self.api.model()
        created = self.api.post("create_sampling_session", {"session_id": session_id})
        self.sampler = created.json()["sampling_session_id"]

    def forward_backward(self, seq_id: int) -> httpx.Response:
        headers = {**HEADERS, "Content-Type": "application/x-protobuf"}
        body = forward_backward_body(self.model_id, seq_id)
        return httpx.post(
            f"{self.api.base}/forward_backward", content=body, headers=headers, timeout=60
        )

    def sample(self, seq_id: int, prompt_tokens: int = 3) -> httpx.Response:
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [300] * prompt_tokens}]}
        body = {
            "sampling_session_id": self.sampler,
            "seq_id": seq_id,
            "num_samples": 1,
            "prompt": prompt,
            "sampling_params": {"max_tokens": 2, "seed": 1},
        }
        return self.api.post("asample", body)

    def logged_calls(self) -> list[int]:
        """The seq_ids of the calls in the request log, as it is on disk."""
        records = read_records(self.state_dir)
        return [r.seq for r in records if isinstance(r, CallRecord)]


def hold_the_engine(handle: ServerHandle) -> tuple[threading.Event, threading.Event]:
    """The next forward_backward the engine runs waits in it for ``release``; ``running`` is
    set once it does."""
    session = handle.session_host.session
    running, release, original = threading.Event(), threading.Event(), session.forward_backward

    def held(*args: Any, **kwargs: Any) -> Any:
        session.forward_backward = original
        running.set()
        release.wait(120)
        return original(*args, **kwargs)

    session.forward_backward = held
    return running, release


@pytest.fixture
def front(tmp_path: Path, model_root: Path, tiny_llama: Path) -> Iterator[Front]:
    with tinker_server(tmp_path / "state", model_root) as handle:
        yield Front(handle, tmp_path / "state")


@pytest.fixture(params=["per model", "in all"])
def bound(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, int]:
    """One bound at six decoded calls, the other out of the way (set before the server starts)."""
    budget = BUDGET_CALLS * decoded_bytes(parse_forward_backward(forward_backward_body("m", 1)))
    tight, loose = "DEFAULT_MAX_HELD_BYTES", "DEFAULT_MAX_TOTAL_BYTES"
    if request.param == "in all":
        tight, loose = loose, tight
    monkeypatch.setattr(scheduler, tight, budget)
    monkeypatch.setattr(scheduler, loose, 1 << 40)
    return request.param, budget


def test_calls_behind_a_running_one_wait_only_up_to_what_their_decoded_requests_hold(
    bound: tuple[str, int], front: Front
) -> None:
    which, budget = bound
    held = budget // BUDGET_CALLS
    running, release = hold_the_engine(front.handle)
    try:
        first = front.forward_backward(1)
        assert first.status_code == 200, first.text
        assert running.wait(60)
        accepted, refused = [first], None
        for seq_id in range(2, 40):
            response = front.forward_backward(seq_id)
            if response.status_code != 200:
                refused = response
                break
            accepted.append(response)
        assert refused is not None, f"{len(accepted)} calls taken, {held} bytes each"
        assert refused.status_code == 429, refused.text  # the SDK retries it
        message = "wait to run" if which == "per model" else "waiting or running"
        assert message in refused.json()["detail"]
        # The running call and what waits hold at most the bound, and one call past it (the one
        # taken while nothing else waits, so a call larger than the bound still runs).
        assert len(accepted) * held <= budget + held
        assert len(accepted) >= BUDGET_CALLS - 1
        assert front.logged_calls() == list(range(1, len(accepted) + 1))  # refused unlogged
        if which == "in all":  # a sample counts in all too: one holding more than is left
            sample = front.sample(1, prompt_tokens=held // 40)
            assert sample.status_code == 429, sample.text
            assert "waiting or running" in sample.json()["detail"]
    finally:
        release.set()
    for response in accepted:  # everything taken runs and answers
        answer = front.api.poll(response.json()["request_id"])
        assert answer.headers["content-type"] == codec.PROTOBUF, answer.text
    again = front.forward_backward(len(accepted) + 1)  # the SDK's retry, once they have run
    assert again.status_code == 200, again.text
    assert front.api.poll(again.json()["request_id"]).headers["content-type"] == codec.PROTOBUF
    sample = front.sample(1)
    assert sample.status_code == 200, sample.text
    assert front.api.poll(sample.json()["request_id"]).status_code == 200
