"""SDK sessions are forgotten once their client is gone: a session silent past the lapse, with
nothing of its own still asked for, leaves the known sessions, the futures, the sampling sessions
and the request store, and a restart does not bring it back; one still heartbeating, calling, with
a result to fetch or with the open model stays. In process, over raw HTTP as the SDK sends it,
with the sessions' clock moved by hand instead of waiting out the lapse."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from test_tinker_exactly_once import log_records, raw, save
from tinker_loops import KEY, RawFront, tinker_server

from trainwire.server.process import ServerHandle
from trainwire.server.service.host import SessionHost
from trainwire.server.service.intake import Intake
from trainwire.server.service.request_records import SessionRecord, owner_of_record
from trainwire.server.tinker.codec import PROTOBUF
from trainwire.server.tinker.model_table import SESSION_KEEP_S
from trainwire.server.tinker.sdk_sessions import session_of


class Clock:
    """The sessions' monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def with_clock(handle: ServerHandle) -> Clock:
    clock = Clock()
    handle.tinker.front.models.sessions.clock = clock
    return clock


def new_session(api: RawFront) -> str:
    return api.post("create_session", {}).json()["session_id"]


def sampling_session(api: RawFront, session_id: str) -> str:
    created = api.post("create_sampling_session", {"session_id": session_id})
    return created.json()["sampling_session_id"]


def asample(api: RawFront, sampler: str, seq_id: int) -> httpx.Response:
    """A three-token sample of ``sampler``."""
    body: dict[str, Any] = {
        "sampling_session_id": sampler,
        "seq_id": seq_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 3, "seed": 7},
    }
    return api.post("asample", body)


def sample(api: RawFront, sampler: str, seq_id: int) -> str:
    """A sample's request id (answered once it ran)."""
    return asample(api, sampler, seq_id).json()["request_id"]


def resolved_unfetched(handle: ServerHandle, request_id: str) -> None:
    """Wait until ``request_id`` has its result, without a poll (none is handed out)."""
    futures = handle.tinker.front.intake.results
    deadline = time.monotonic() + 60
    while futures.pending(request_id):
        assert time.monotonic() < deadline, f"{request_id} still pending"
        time.sleep(0.01)


def logged_sessions(state_dir: Path) -> set[str]:
    return {r.session_id for r in log_records(state_dir) if isinstance(r, SessionRecord)}


def beat(api: RawFront, session_id: str) -> int:
    return api.post("session_heartbeat", {"session_id": session_id}).status_code


def sampler_status(api: RawFront, sampler: str) -> int:
    return httpx.get(f"{api.base}/samplers/{sampler}", headers={"X-API-Key": KEY}).status_code


def train_once(api: RawFront, model_id: str) -> None:
    """A forward_backward at seq_id 1: a save after it compacts the log."""
    assert api.poll(api.forward_backward(model_id, 1).json()["request_id"]).status_code == 200


def test_lapsed_sessions_leave_memory_and_the_compacted_log(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """(a) Many sessions created and abandoned, one with a sampling session and a fetched
    sample: past the lapse, the next compaction keeps only the model's session and the one still
    heartbeating, in the log and in memory."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        front = handle.tinker.front
        clock = with_clock(handle)
        api = raw(handle)
        model_session, model_id = api.model()
        live = new_session(api)
        abandoned = [new_session(api) for _ in range(100)]
        sampler = sampling_session(api, abandoned[0])
        sampled = sample(api, sampler, 1)
        assert api.poll(sampled).headers["content-type"] == PROTOBUF
        assert len(front.models.sessions) == 102
        clock.advance(SESSION_KEEP_S + 1)
        assert beat(api, live) == 200
        train_once(api, model_id)
        assert "path" in save(api, model_id, 2, "first")  # compacts the log
        records = log_records(state_dir)
        assert logged_sessions(state_dir) == {model_session, live}
        assert not any(owner_of_record(r, session_of) in abandoned for r in records)
        assert set(front.models.sessions) == {model_session, live}
        assert len(front.sampling_sessions) == 0
        assert not front.intake.results.known(sampled)
        refused = api.post("session_heartbeat", {"session_id": abandoned[1]})
        assert (
            refused.status_code == 404
            and f"forgotten after {SESSION_KEEP_S:.0f} s" in refused.json()["detail"]
        )
        assert api.post("retrieve_future", {"request_id": sampled}).status_code == 404
        assert asample(api, sampler, 2).status_code == 404
        assert sampler_status(api, sampler) == 404
        assert api.post("create_model", {"session_id": abandoned[2]}).status_code == 404


def test_a_restart_does_not_bring_forgotten_sessions_back(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """(b) Sessions forgotten between compactions (on a create_session) are left out of a
    restart: their records leave the store at once."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        clock = with_clock(handle)
        api = raw(handle)
        live = [new_session(api) for _ in range(30)]
        abandoned = [new_session(api) for _ in range(20)]
        sampler = sampling_session(api, abandoned[0])
        clock.advance(SESSION_KEEP_S + 1)
        assert all(beat(api, session_id) == 200 for session_id in live)
        newest = new_session(api)  # looks for lapsed sessions: the twenty go
        assert set(handle.tinker.front.models.sessions) == {*live, newest}
        records = log_records(state_dir)
        assert not any(owner_of_record(r, session_of) in abandoned for r in records)
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        assert set(handle.tinker.front.models.sessions) == {*live, newest}
        assert all(beat(api, session_id) == 404 for session_id in abandoned)
        assert beat(api, live[0]) == 200
        assert sampler_status(api, sampler) == 404


def test_a_session_heartbeating_calling_with_a_result_to_fetch_or_the_model_is_kept(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """(c) Past the lapse, the model's session, one heartbeating, one whose sampling session was
    just called and one with a sample never fetched are kept, in memory, in the compacted log
    and across a restart; once its sample is fetched, the last one goes at the next lapse."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        clock = with_clock(handle)
        api = raw(handle)
        model_session, model_id = api.model()
        beating, calling, waiting, gone = (new_session(api) for _ in range(4))
        calling_sampler = sampling_session(api, calling)
        unfetched = sample(api, sampling_session(api, waiting), 1)
        resolved_unfetched(handle, unfetched)
        clock.advance(SESSION_KEEP_S / 2 + 1)
        assert beat(api, beating) == 200
        assert api.poll(sample(api, calling_sampler, 1)).headers["content-type"] == PROTOBUF
        clock.advance(SESSION_KEEP_S / 2 + 1)
        train_once(api, model_id)
        assert "path" in save(api, model_id, 2, "first")  # compacts the log
        kept = {model_session, beating, calling, waiting}
        assert logged_sessions(state_dir) == kept
        assert set(handle.tinker.front.models.sessions) == kept
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        assert all(beat(api, session_id) == 200 for session_id in kept)
        assert beat(api, gone) == 404
        assert api.poll(unfetched).headers["content-type"] == PROTOBUF
        clock = with_clock(handle)
        clock.advance(SESSION_KEEP_S + 1)
        new_session(api)  # looks for lapsed sessions: all but the model's go now
        assert model_session in handle.tinker.front.models.sessions
        assert beat(api, waiting) == 404


def test_a_front_that_never_compacts_keeps_no_record_of_a_forgotten_session(
    tmp_path: Path, make_host: Callable[..., SessionHost]
) -> None:
    """Without checkpoints the store is never compacted; a forgotten session's records leave it
    at once, so it stays bounded by the live sessions, and a restart does not take them back."""
    host = make_host()
    intake = Intake(host, owner_of=session_of, noun="model")
    try:
        for index in range(6):
            intake.record(SessionRecord(f"tw-{index}"))
        intake.forget_sessions({"tw-0", "tw-1"}, lambda s: s not in {"tw-0", "tw-1"})
        assert intake.store.records == [SessionRecord(f"tw-{index}") for index in range(2, 6)]
        restarted = Intake(host, owner_of=session_of, noun="model")
        with restarted.replaying() as records:
            assert records == [SessionRecord(f"tw-{index}") for index in range(2, 6)]
        restarted.stop()
    finally:
        intake.stop()
