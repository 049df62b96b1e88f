"""The Tinker front's request log: what a crash leaves is read back, compaction keeps what a
restart needs, and a restarted server knows every request id it handed out."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from ledger_files import opened_store, stored_call
from tinker_loops import KEY, tinker_server

from trainwire.server.errors import ResourceExhausted
from trainwire.server.process import ServerHandle
from trainwire.server.service.journal import Journal, JournalEntry
from trainwire.server.service.ledger import Ledger
from trainwire.server.service.request_records import (
    CallRecord,
    ResultRecord,
    ResumeRecord,
    SampleRecord,
    SessionRecord,
)
from trainwire.server.service.request_store import RequestStore, compacted, read_records
from trainwire.server.service.results import Done, Failed
from trainwire.server.tinker.sdk_sessions import session_of


def test_records_come_back_in_order_after_a_reopen(tmp_path: Path) -> None:
    with opened_store(tmp_path) as store:
        store.write(stored_call("m/1", "optim_step", {"seq_id": 1}, "optim_step"))
        store.write(stored_call("m/2", "forward_backward", b"\x00proto", "forward_backward"))
    with opened_store(tmp_path) as again:
        assert [r.request_id for r in again.records] == ["m/1", "m/2"]  # type: ignore[union-attr]
        again.write(ResultRecord("m/2", Done(b"\x01bytes")))
    with opened_store(tmp_path) as third:
        assert third.records[-1] == ResultRecord("m/2", Done(b"\x01bytes"))
    assert read_records(tmp_path)[-1] == ResultRecord("m/2", Done(b"\x01bytes"))


def test_requests_and_journal_entries_written_together_share_one_commit(tmp_path: Path) -> None:
    """The ledger's one writer: a record and a run's journal entry queued while the last commit
    reaches the disk are committed together, in one transaction (one fsync)."""
    with Ledger(tmp_path) as ledger:
        store, journal = RequestStore(ledger, session_of), Journal(ledger, "run")
        writing, release, batches = threading.Event(), threading.Event(), []
        real_transact = ledger._transact

        def transact(writes):
            writing.set()
            release.wait(30)
            batches.append([write.label for write in writes])
            return real_transact(writes)

        ledger._transact = transact  # type: ignore[method-assign]
        first = store.append(SessionRecord("tw-a"))
        assert writing.wait(30)  # the writer holds it on its way to the disk
        ticket = store.append(SampleRecord("tw-a:sample:0/1", {"seq_id": 1}))
        entry = journal.commit_async(JournalEntry("m/1", "OptimStep", "sha256:x", 1, {}))
        release.set()
        store.sync(first)
        store.sync(ticket)
        entry.result(timeout=30)
        assert batches == [["record session"], ["record sample", "m/1"]]
        assert journal.lookup("m/1") is not None and len(read_records(tmp_path)) == 2


def test_a_full_disk_refuses_the_request_and_leaves_no_half_record(tmp_path: Path) -> None:
    with opened_store(tmp_path) as store:
        store.write(stored_call("m/1", "optim_step", {"seq_id": 1}, "optim_step"))
        before = read_records(tmp_path)
        ledger = store.ledger
        (pages,) = ledger.write_now(lambda db: db.execute("PRAGMA page_count").fetchone())
        # No page more for the writer: SQLite's disk is full.
        ledger.write_now(lambda db: db.execute(f"PRAGMA max_page_count={pages}"))
        big = stored_call("m/2", "forward_backward", bytes(range(256)) * 400, "forward_backward")
        with pytest.raises(ResourceExhausted, match="disk is full"):
            store.sync(store.append(big))
        assert read_records(tmp_path) == before and len(store.records) == 1
        ledger.write_now(lambda db: db.execute("PRAGMA max_page_count=1073741823"))
        assert store.write_result("m/3", Done({"ok": 1})) == Done({"ok": 1})
    with opened_store(tmp_path) as reopened:
        stored = reopened.records
    assert [r.request_id for r in stored] == ["m/1", "m/3"]  # type: ignore[union-attr]


def test_a_corrupt_record_is_an_error_not_a_silent_loss(tmp_path: Path) -> None:
    with opened_store(tmp_path) as store:
        store.write(SessionRecord("tw-1"))
        store.ledger.write_now(lambda db: db.execute("UPDATE records SET record = 'not json'"))
    with pytest.raises(ValueError, match="row 1 is corrupt"), opened_store(tmp_path):
        pass


def test_forgetting_sessions_deletes_their_records_for_good(tmp_path: Path) -> None:
    with opened_store(tmp_path) as store:
        for record in (
            SessionRecord("tw-a"),
            SessionRecord("tw-b"),
            SampleRecord("tw-b:sample:0/1", {"seq_id": 1}),
            ResultRecord("tw-b:sample:0/1", Done({"ok": 1})),
            SampleRecord("tw-a:sample:0/1", {"seq_id": 1}),
        ):
            store.write(record)
        store.forget({"tw-b"})
        kept = [SessionRecord("tw-a"), SampleRecord("tw-a:sample:0/1", {"seq_id": 1})]
        assert store.records == kept and read_records(tmp_path) == kept


def test_compaction_keeps_the_calls_since_the_checkpoint_and_undelivered_samples() -> None:
    records = [
        stored_call("m/1", "optim_step", {}, "optim_step"),
        stored_call("m/2", "forward_backward", b"x", "forward_backward"),
        ResultRecord("m/2", Failed("bad loss", "user")),
        SampleRecord("s/1", {}),
        SampleRecord("s/2", {}),
        ResultRecord("s/2", Done(b"y")),
        stored_call("m/3", "save_weights", {}, "save_weights"),
        stored_call("m/4", "optim_step", {}, "optim_step"),
    ]
    head = [SessionRecord("tw-1"), ResumeRecord(3, 2, "m")]
    delivered = {"m/1", "m/2", "s/1"}
    kept = compacted(records, "m", 3, delivered.__contains__, head)
    assert kept == [*head, records[4], records[5], records[6], records[7]]
    assert compacted(records, "m", 3, {"m/1", "s/1"}.__contains__, head) is None  # m/2 unpolled


def test_compacting_one_models_records_keeps_every_other_models_calls() -> None:
    """Many models on one server: a checkpoint of model "a" drops a's calls before it only;
    model "b"'s calls (before any checkpoint of b's) replay after a restart as they are."""
    records = [
        stored_call("a/1", "optim_step", {}, "optim_step"),
        stored_call("b/1", "optim_step", {}, "optim_step"),
        ResultRecord("b/1", Failed("bad step", "user")),
        stored_call("a/2", "save_weights", {}, "save_weights"),
        stored_call("b/2", "optim_step", {}, "optim_step"),
        stored_call("a/3", "optim_step", {}, "optim_step"),
    ]
    head = [ResumeRecord(2, 1, "a")]
    every = {"a/1", "b/1", "a/2", "b/2"}.__contains__
    kept = compacted(records, "a", 2, every, head, ordered={"a", "b"}.__contains__)
    assert kept == [*head, records[1], records[2], records[3], records[4], records[5]]


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
    calls = [r for r in read_records(state_dir) if isinstance(r, CallRecord)]
    assert [call.seq for call in calls] == [2]  # compacted at "late"
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

    from trainwire.server.tinker import model_table

    monkeypatch.setattr(model_table, "SESSION_LAPSE_S", 2.0)
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
