"""The Tinker front's request log: what a crash leaves is read back, compaction keeps what a
restart needs, and a restarted server knows every request id it handed out."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from tinker_loops import KEY, tinker_server

from trainwire.server.errors import ResourceExhausted
from trainwire.server.process import ServerHandle
from trainwire.server.service.request_log import LOG_FILE, RequestLog, compacted
from trainwire.server.service.request_records import (
    CallRecord,
    ResultRecord,
    ResumeRecord,
    SampleRecord,
    SessionRecord,
)
from trainwire.server.service.results import Done, Failed


def test_records_come_back_in_order_and_a_torn_last_one_is_dropped(tmp_path: Path) -> None:
    log = RequestLog(tmp_path)
    log.write(CallRecord("optim_step", "m/1", 1, {"seq_id": 1}))
    log.write(CallRecord("forward_backward", "m/2", 2, b"\x00proto", "zstd"))
    log.close()
    with (tmp_path / LOG_FILE).open("ab") as file:
        file.write(b'{"kind": "call", "rou')  # the crash came mid-write
    again = RequestLog(tmp_path)
    assert [r.request_id for r in again.records] == ["m/1", "m/2"]
    assert (tmp_path / LOG_FILE).read_bytes().endswith(b"}\n")  # the torn bytes are cut off
    again.write(ResultRecord("m/2", Done(b"\x01bytes")))
    again.close()
    assert RequestLog(tmp_path).records[-1] == ResultRecord("m/2", Done(b"\x01bytes"))


def test_a_full_disk_refuses_the_request_and_leaves_no_half_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = RequestLog(tmp_path)
    log.write(CallRecord("optim_step", "m/1", 1, {"seq_id": 1}))
    before = (tmp_path / LOG_FILE).read_bytes()
    real_write = os.write
    calls = []

    def half_then_full(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))  # a short write, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(ResourceExhausted, match="disk is full"):
        log.append(CallRecord("optim_step", "m/2", 2, {"seq_id": 2}))
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / LOG_FILE).read_bytes() == before
    assert log.write_result("m/3", Done({"ok": 1})) == Done({"ok": 1})
    log.close()
    assert [r.request_id for r in RequestLog(tmp_path).records] == ["m/1", "m/3"]


def test_a_corrupt_record_before_the_last_is_an_error_not_a_silent_loss(tmp_path: Path) -> None:
    session = b'{"kind": "session", "session_id": "tw-1"}\n'
    (tmp_path / LOG_FILE).write_bytes(session + b"not json\n" + session)
    with pytest.raises(ValueError, match="record 2 is corrupt"):
        RequestLog(tmp_path)


def test_compaction_keeps_the_calls_since_the_checkpoint_and_undelivered_samples() -> None:
    records = [
        CallRecord("optim_step", "m/1", 1, {}),
        CallRecord("forward_backward", "m/2", 2, b"x", ""),
        ResultRecord("m/2", Failed("bad loss", "user")),
        SampleRecord("s/1", {}),
        SampleRecord("s/2", {}),
        ResultRecord("s/2", Done(b"y")),
        CallRecord("save_weights", "m/3", 3, {}),
        CallRecord("optim_step", "m/4", 4, {}),
    ]
    head = [SessionRecord("tw-1"), ResumeRecord(3, 2)]
    delivered = {"m/1", "m/2", "s/1"}
    kept = compacted(records, 3, delivered.__contains__, head)
    assert kept == [*head, records[4], records[5], records[6], records[7]]
    assert compacted(records, 3, {"m/1", "s/1"}.__contains__, head) is None  # m/2 unpolled


class FrontApi:
    """Raw HTTP calls to a server's Tinker front, as the SDK makes them."""

    def __init__(self, handle: ServerHandle) -> None:
        self.base = f"{handle.tinker.base_url}/api/v1"

    def post(self, route: str, body: Any = None) -> httpx.Response:
        headers = {"X-API-Key": KEY}
        return httpx.post(f"{self.base}/{route}", json=body, headers=headers, timeout=60)

    def session(self) -> str:
        return self.post("create_session", {}).json()["session_id"]

    def create_model(
        self, session_id: str, model_seq_id: int = 0, lora_rank: int | None = None
    ) -> httpx.Response:
        body: dict[str, Any] = {"session_id": session_id, "base_model": "llama"}
        body["model_seq_id"] = model_seq_id
        if lora_rank is not None:
            body["lora_config"] = {"rank": lora_rank}
        return self.post("create_model", body)

    def model(self) -> tuple[str, str]:
        """A new session and its model: (session id, model id)."""
        session_id = self.session()
        return session_id, self.create_model(session_id).json()["model_id"]

    def result(self, request_id: dict[str, Any]) -> dict[str, Any]:
        return self.post("retrieve_future", request_id).json()


def test_a_restarted_server_answers_an_old_request_id_and_refuses_its_reuse(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = FrontApi(handle)
        session_id, model_id = api.model()
        save = {"model_id": model_id, "seq_id": 1, "path": "first"}
        request_id = api.post("save_weights", save).json()
        first = api.result(request_id)
    with tinker_server(state_dir, model_root) as handle:
        api = FrontApi(handle)
        assert api.result(request_id) == first and first["path"].endswith("/weights/first")
        resent = api.post("save_weights", save)
        assert resent.json() == request_id  # a re-send finds its request, nothing runs twice
        assert handle.session_host.info().position == 1
        refused = api.post("save_weights", {**save, "path": "second"})
        assert refused.status_code == 400 and "another payload" in refused.json()["detail"]
        beat = api.post("session_heartbeat", {"session_id": session_id})
        assert beat.status_code == 200  # the SDK's session outlives the restart


def test_a_restart_behind_the_compacted_log_refuses_to_go_on_rather_than_skip_calls(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = FrontApi(handle)
        _, model_id = api.model()
        for seq_id, name in enumerate(("early", "late"), 1):
            save = {"model_id": model_id, "seq_id": seq_id, "path": name}
            assert "path" in api.result(api.post("save_weights", save).json())
        run_id = handle.session_host.info().run_id
    log = (state_dir / "tinker" / LOG_FILE).read_text()
    assert '"route":"save_weights","seq":1' not in log  # compacted at "late"
    late = state_dir / "runs" / run_id / "checkpoints" / "late" / "model.safetensors"
    late.write_bytes(late.read_bytes()[:100])  # recovery falls back to "early"
    with tinker_server(state_dir, model_root) as handle:
        answer = FrontApi(handle).result({"request_id": f"{model_id}/2"})  # kept, replayed
        assert answer["category"] == "server"
        assert "cannot go on exactly once" in answer["error"]
        assert handle.session_host.info().restored_checkpoint == "early"


def test_closing_another_session_keeps_the_models_requests(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = FrontApi(handle)
        other = api.session()
        _, model_id = api.model()
        save = {"model_id": model_id, "seq_id": 1, "path": "kept"}
        request_id = api.post("save_weights", save).json()
        assert api.post(f"sessions/{other}/finish").status_code == 200
    with tinker_server(state_dir, model_root) as handle:
        assert FrontApi(handle).result(request_id)["path"].endswith("/weights/kept")
        assert handle.session_host.info().state == "open"


def test_a_model_whose_client_went_silent_gives_way_to_a_new_one(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from trainwire.server.tinker import model_slot

    monkeypatch.setattr(model_slot, "SESSION_LAPSE_S", 2.0)
    with tinker_server(tmp_path / "state", model_root) as handle:
        api = FrontApi(handle)
        _, old_model = api.model()
        new = api.session()
        refused = api.create_model(new)
        # 503: the SDK retries it, so a script run again gets the model once the old one lapses
        assert refused.status_code == 503 and "sent nothing for 2 s" in refused.json()["detail"]
        time.sleep(2.2)  # the old client sends nothing: no request, no heartbeat
        assert api.create_model(new).status_code == 200
        assert api.post("get_info", {"model_id": old_model}).status_code == 404
        assert handle.session_host.info().run_id != old_model.replace(":", "-")
