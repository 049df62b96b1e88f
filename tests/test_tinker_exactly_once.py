"""Exactly once on the Tinker front, where a hostile review saw it break: a closed model's queued
calls, a result whose poll response was lost, a sample re-sent under a used key with another
prompt, a logged call that cannot be replayed, what may wait for its turn, and what a compacted
request log keeps. In process, over raw HTTP as the SDK sends it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tinker
from ledger_files import opened_store, stored_call, stored_refusal, stored_save
from service_fixtures import wait_for
from tinker import types
from tinker_loops import (
    SENTENCES,
    RawFront,
    forward_backward_body,
    service_client,
    supervised_datum,
    tinker_server,
)

from trainwire.server.process import ServerHandle
from trainwire.server.service import results as result_store
from trainwire.server.service import scheduler
from trainwire.server.service.request_records import (
    CallRecord,
    Record,
    SessionRecord,
)
from trainwire.server.service.request_store import read_records
from trainwire.server.tinker import codec, model, model_table, training_routes
from trainwire.server.tinker.sampling_sessions import snapshot_export


def raw(handle: ServerHandle) -> RawFront:
    return RawFront(handle.tinker.base_url)


def log_records(state_dir: Path) -> list[Record]:
    """The front's request log as it is on disk (read without opening it for writing)."""
    return read_records(state_dir)


def logged_calls(state_dir: Path) -> list[int]:
    return [r.seq for r in log_records(state_dir) if isinstance(r, CallRecord)]


def hold_the_calls(handle: ServerHandle) -> threading.Event:
    """Keep the front's calls from running until the returned event is set (the engine is busy
    with a job that waits for it): what is sent meanwhile waits for its turn."""
    gate = threading.Event()
    handle.tinker.front.intake.scheduler.run_unordered(lambda: gate.wait(60))
    return gate


def save(api: RawFront, model_id: str, seq_id: int, path: str) -> dict[str, Any]:
    request_id = api.post("save_weights", {"model_id": model_id, "seq_id": seq_id, "path": path})
    return api.poll(request_id.json()["request_id"]).json()


def test_a_closed_models_queued_calls_fail_and_never_run_on_the_next_model(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Item 2: client A queues forward_backwards (held for the seq_id before them) and closes
    its session; client B creates a model; A's calls then fail (``user``: its model was closed)
    and B's run holds none of them. (Held in their stream, not behind a busy engine: the one
    queue runs B's create_model in its turn.)"""
    with tinker_server(tmp_path / "state", model_root) as handle:
        api = raw(handle)
        a_session, a_model = api.model()
        queued = [api.forward_backward(a_model, seq).json()["request_id"] for seq in (2, 3, 4)]
        assert api.post(f"sessions/{a_session}/finish").status_code == 200
        _, b_model = api.model()
        for request_id in queued:
            answer = api.poll(request_id)
            assert answer.headers["content-type"] != codec.PROTOBUF, "it ran on B's run"
            assert answer.json()["category"] == "user" and "was closed" in answer.json()["error"]
        assert handle.session_host.info().position == 0  # nothing of A's applied to B's run
        trained = api.poll(api.forward_backward(b_model, 1).json()["request_id"])
        assert trained.headers["content-type"] == codec.PROTOBUF
        assert handle.session_host.info().position == 1


def test_a_result_whose_poll_response_was_lost_is_answered_after_a_compaction_and_a_restart(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Item 3: a forward_backward's result is handed to a poll whose response is lost; a save
    compacts the request log and the server restarts: the SDK's retried poll gets the same
    result, a re-send of the call finds it, another payload under its key is refused."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        _, model_id = api.model()
        request_id = api.forward_backward(model_id, 1).json()["request_id"]
        first = api.poll(request_id)  # handed out; the SDK never got it
        assert first.headers["content-type"] == codec.PROTOBUF
        assert save(api, model_id, 2, "after")["path"].endswith("/weights/after")
        assert 1 not in logged_calls(state_dir)  # the call's record is compacted away
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        assert api.poll(request_id).content == first.content
        assert api.forward_backward(model_id, 1).json()["request_id"] == request_id  # a re-send
        refused = api.forward_backward(model_id, 1, tokens=(5, 4, 3, 2, 1))
        assert refused.status_code == 400 and "another payload" in refused.json()["detail"]
        assert handle.session_host.info().position == 2  # nothing ran again


def test_retention_keeps_the_newest_results_within_their_time_count_and_bytes() -> None:
    """Item 3's bound: handed-out results for an hour, undelivered ones for a day, the newest
    4,096 (and 64 / 256 MiB) of each at most."""
    now = 10_000_000.0

    def result(name: str, age_s: float, delivered: bool, size: int = 10) -> result_store.Resolved:
        at = now - age_s
        outcome = result_store.Done(b"x" * size)
        return result_store.Resolved(name, outcome, None, at, at if delivered else None)

    resolved = [
        result("recent", 60, True),
        result("hour-old", 3601, True),
        result("day-undelivered", 23 * 3600, False),
        result("old-undelivered", 25 * 3600, False),
        result("huge", 1, True, result_store.KEEP_DELIVERED.size + 1),
    ]
    kept = {r.request_id for r in result_store.retained(resolved, now)}
    assert kept == {"day-undelivered"}  # the huge newest one fills the bytes: none after it
    kept = {r.request_id for r in result_store.retained(resolved[:4], now)}
    assert kept == {"recent", "day-undelivered"}


def test_a_poller_watching_a_result_does_not_hand_it_out() -> None:
    """The SDK's sampling poller (``retrieve_futures``) learns a result is there without
    fetching it: the result keeps the undelivered retention (a day) until ``retrieve_future``
    hands it out (an hour from then)."""
    store = result_store.ResultStore()
    store.add("s/1")
    store.resolve("s/1", result_store.Done(b"x"))
    assert asyncio.run(store.wait("s/1", 0, hand_out=False)) is not None
    assert not store.delivered("s/1")
    asyncio.run(store.wait("s/1", 0))
    assert store.delivered("s/1")


def test_a_fetch_cancelled_or_on_a_closed_loop_never_breaks_the_result_it_waited_for() -> None:
    """A fetch whose client went away (its task cancelled) leaves no waiter behind, and a
    result resolved after a waiter's event loop closed (a listener stopped under a held fetch)
    resolves all the same: resolving runs on a commit's thread, and a stopping server waits
    until every result finishing there has (it waited for good when the wake-up raised)."""
    store = result_store.ResultStore()
    store.add("s/1")
    store.add("s/2")

    async def cancelled_fetch() -> None:
        fetch = asyncio.ensure_future(store.wait("s/1", 60))
        await asyncio.sleep(0.01)
        fetch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fetch

    asyncio.run(cancelled_fetch())
    assert "s/1" not in store._waiters  # the cancelled fetch's waiter went with it
    loop = asyncio.new_event_loop()
    held = loop.create_task(store.wait("s/2", 60))
    loop.run_until_complete(asyncio.sleep(0.01))  # s/2's waiter is registered on ``loop``
    held.cancel()  # as a listener stopping cancels its tasks, but the waiter's loop closes
    loop.close()  # before the fetch's cleanup ran
    for request_id in ("s/1", "s/2"):
        store.resolve(request_id, result_store.Done(b"x"))
        assert asyncio.run(store.wait(request_id, 0)) == result_store.Done(b"x")


def test_a_sample_under_a_used_key_with_another_prompt_is_refused(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Item 4: the same (sampling session, seq_id) with the same body is the re-send it is;
    with another prompt it is refused (400), before and after a restart."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        session_id, _ = api.model()
        created = api.post("create_sampling_session", {"session_id": session_id})
        sampler = created.json()["sampling_session_id"]
        body = {
            "sampling_session_id": sampler,
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 3, "seed": 7},
        }
        other = {**body, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [9, 8]}]}}
        request_id = api.post("asample", body).json()["request_id"]
        first = api.poll(request_id).content
        assert api.post("asample", body).json()["request_id"] == request_id
        refused = api.post("asample", other)
        assert refused.status_code == 400 and "another payload" in refused.json()["detail"]
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        assert api.post("asample", other).status_code == 400
        assert api.post("asample", body).json()["request_id"] == request_id
        assert api.poll(request_id).content == first


def test_a_snapshot_re_sent_with_a_new_sampling_session_seq_id_is_answered_its_first_try(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """The SDK draws ``sampling_session_seq_id`` anew on each try of one unnamed
    ``save_weights_for_sampler`` (same seq_id): a re-send after a lost answer, before and after
    a restart, is that request, answered with the first try's sampling session; another change
    under the same seq_id is still refused (found by the four-run SIGKILL test: the re-send was
    refused as another payload, and the SDK failed the loop)."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        _, model_id = api.model()
        body = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0}
        request_id = api.post("save_weights_for_sampler", body).json()["request_id"]
        first = api.poll(request_id).json()
        assert first["sampling_session_id"].endswith(":sample:0")
        retry = {**body, "sampling_session_seq_id": 1}
        assert api.post("save_weights_for_sampler", retry).json()["request_id"] == request_id
        assert api.poll(request_id).json() == first
        other = api.post("save_weights_for_sampler", {**body, "kind": "inflight"})
        assert other.status_code == 400 and "another payload" in other.json()["detail"]
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        retry = {**body, "sampling_session_seq_id": 2}
        assert api.post("save_weights_for_sampler", retry).json()["request_id"] == request_id
        assert api.poll(request_id).json() == first


def test_a_logged_call_that_fails_on_replay_fails_alone_and_the_server_starts(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Item 5 (replay side): records the intake cannot queue again (a request that is not an
    object, an operation this version does not have) fail their own requests with a ``server``
    error, logged; the server starts and the call after them runs."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        _, model_id = api.model()
        assert "path" in save(api, model_id, 1, "one")
    with opened_store(state_dir) as log:
        not_an_object: Any = ["not", "an", "object"]
        log.write(stored_call(f"{model_id}/2", "OptimStep", not_an_object, "optim_step"))
        log.write(stored_call(f"{model_id}/3", "from_a_newer_version", {}, "optim_step"))
        log.write(stored_save(model_id, 4, "four"))
    answers = []
    for _ in range(2):  # the failures are logged: the second start answers them as they were
        with tinker_server(state_dir, model_root) as handle:
            api = raw(handle)
            answers.append([api.poll(f"{model_id}/{seq}").json() for seq in (2, 3)])
            assert api.poll(f"{model_id}/4").json()["path"].endswith("/weights/four")
            assert handle.session_host.info().position == 2
    assert answers[0] == answers[1]
    assert all(a["category"] == "server" and "replaying" in a["error"] for a in answers[0])


def test_a_restart_queues_a_stored_call_from_its_record_and_decodes_nothing_again(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ledger, one queue: a stored call is queued again from its typed record (operation,
    request, run, note), not given to its route: with the route's decoding made to fail after
    the restart, the stored save still runs and answers as the route would have, and a call
    refused when it was accepted is answered the same refusal (it held its number)."""
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        _, model_id = raw(handle).model()
    with opened_store(state_dir) as log:
        log.write(stored_refusal(f"{model_id}/1", "save_weights path: a bad name"))
        log.write(stored_save(model_id, 2, "kept"))

    def refuse(*args: Any) -> str:
        raise AssertionError("a stored call was decoded again by its route")

    monkeypatch.setattr(training_routes, "check_name", refuse)
    with tinker_server(state_dir, model_root) as handle:
        refused = raw(handle).poll(f"{model_id}/1").json()
        assert refused == {"error": "save_weights path: a bad name", "category": "user"}
        answer = raw(handle).poll(f"{model_id}/2").json()
        assert answer == {"type": "save_weights", "path": f"tinker://{model_id}/weights/kept"}
        assert handle.session_host.info().position == 1


def test_calls_waiting_for_their_turn_are_bounded_in_bytes_and_refused_before_the_log(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 9: behind a running call, forward_backwards wait up to the model's byte budget; the
    next is refused with 429 (the SDK retries it) and not logged; once they ran it is taken."""
    body = forward_backward_body("tw-0123456789abcdef:train:0", 1, (1, 2, 3, 4, 5))
    size = codec.held_bytes(codec.parse_forward_backward(body))  # what each holds decoded
    monkeypatch.setattr(scheduler, "DEFAULT_MAX_HELD_BYTES", 3 * size + size // 2)
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        _, model_id = api.model()
        gate = hold_the_calls(handle)
        taken = [api.forward_backward(model_id, seq) for seq in (1, 2, 3)]
        assert [r.status_code for r in taken] == [200, 200, 200]
        refused = api.forward_backward(model_id, 4)
        assert refused.status_code == 429 and "wait to run" in refused.json()["detail"]
        held = api.forward_backward(model_id, 6)  # not its turn either: held calls count too
        assert held.status_code == 429
        assert logged_calls(state_dir) == [1, 2, 3]  # refused before anything was logged
        gate.set()
        for response in taken:
            api.poll(response.json()["request_id"])
        again = api.forward_backward(model_id, 4)  # the SDK's retry
        assert again.status_code == 200
        assert api.poll(again.json()["request_id"]).headers["content-type"] == codec.PROTOBUF


def pipelined_steps(
    service: tinker.ServiceClient, steps: int = 2, before: Callable[[], None] = lambda: None
) -> list[Any]:
    """Six forward_backwards and an optim_step sent before any is awaited, ``steps`` times;
    ``before()`` once the model is made, before anything is sent."""
    training = service.create_lora_training_client(base_model="llama", rank=4).result()
    tokenizer = training.get_tokenizer()
    before()
    seen: list[Any] = []
    for _ in range(steps):
        data = [[supervised_datum(tokenizer, text)] for text in SENTENCES * 2]
        sent = [training.forward_backward(datum, "cross_entropy") for datum in data]
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        seen.append([future.result(timeout=120).metrics["loss:sum"] for future in sent])
        seen.append(optim.result(timeout=120).metrics)
    return seen


def test_the_sdk_retries_a_call_refused_past_the_bound_and_gets_an_unbounded_runs_answers(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 9 with the real SDK: under a one-byte budget every call that would wait behind a
    waiting one is refused (429); the SDK retries and its loop ends with the answers of a
    server without the bound. (The weights' digest is not compared in process: the SDK's retry
    jitter draws from the global ``random`` the in-process session's RNG state holds.)"""
    with tinker_server(tmp_path / "unbounded", model_root) as handle:
        expected = pipelined_steps(service_client(handle))
    refused: list[Exception] = []
    check_room = scheduler.Scheduler._check_room

    def counted(order: scheduler.Scheduler, *args: Any, **kwargs: Any) -> None:
        try:
            check_room(order, *args, **kwargs)
        except Exception as error:
            refused.append(error)
            raise

    monkeypatch.setattr(scheduler.Scheduler, "_check_room", counted)
    monkeypatch.setattr(scheduler, "DEFAULT_MAX_HELD_BYTES", 1)
    with tinker_server(tmp_path / "bounded", model_root) as handle:

        def hold_until_refused() -> None:
            """The first calls wait behind a held engine until one is refused, however fast
            the engine would have run them: the bound is met whatever the machine's load."""
            gate = hold_the_calls(handle)

            def release_once_refused() -> None:
                try:
                    wait_for(lambda: bool(refused), 60)
                finally:
                    gate.set()

            threading.Thread(target=release_once_refused).start()

        assert pipelined_steps(service_client(handle), before=hold_until_refused) == expected
    assert refused


def test_a_refused_call_nobody_polls_leaves_compaction_going_and_what_it_keeps_bounded(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 14: a refused call (400) takes its seq_id and nobody polls it; each save still
    compacts the log, and the results it carries stay within retention (here two of each)."""
    for name in ("KEEP_DELIVERED", "KEEP_UNDELIVERED"):
        monkeypatch.setattr(result_store, name, result_store.Retention(3600.0, 2, 1 << 20))
    state_dir = tmp_path / "state"
    sizes = []
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        _, model_id = api.model()
        for round_ in range(4):
            bad = {"model_id": model_id, "seq_id": 2 * round_ + 1, "path": "../outside"}
            assert api.post("save_weights", bad).status_code == 400
            assert "path" in save(api, model_id, 2 * round_ + 2, f"round-{round_}")
            assert logged_calls(state_dir) == [2 * round_ + 2]  # compacted at this save
            sizes.append(len(log_records(state_dir)))
    assert sizes[1] == sizes[2] == sizes[3]


def test_a_compacted_log_keeps_the_sessions_still_alive_not_every_one_ever_made(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 14: sessions created and abandoned are not rewritten into each compacted log (nor
    read back at each restart); the model's own session and live ones are."""
    monkeypatch.setattr(model_table, "SESSION_KEEP_S", 1.0)
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = raw(handle)
        model_session, model_id = api.model()
        for _ in range(20):
            api.post("create_session", {})
        assert "path" in save(api, model_id, 1, "first")
        time.sleep(1.2)  # the twenty go silent
        live = api.post("create_session", {}).json()["session_id"]
        assert "path" in save(api, model_id, 2, "second")
        sessions = {r.session_id for r in log_records(state_dir) if isinstance(r, SessionRecord)}
        assert sessions == {model_session, live}
    with tinker_server(state_dir, model_root) as handle:
        beat = raw(handle).post("session_heartbeat", {"session_id": model_session})
        assert beat.status_code == 200


def test_named_sampler_weights_a_crash_left_before_their_entry_committed_are_written_again(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Named sampler weights are written once: a second save under the name is refused. A
    folder a crash left (written, its journal entry never committed: nobody was answered it)
    is no save: the call, replayed, writes it and answers as an uninterrupted run does."""
    with tinker_server(tmp_path / "state", model_root) as handle:
        api = raw(handle)
        _, model_id = api.model()
        run = handle.session_host.state_dir.run(model.run_id_for(model_id))
        left = run.export(snapshot_export(1, "named"))
        left.mkdir(parents=True)
        (left / "half-written").write_bytes(b"left by a crash")
        body = {"model_id": model_id, "seq_id": 1, "sampling_session_seq_id": 0, "path": "named"}
        first = api.poll(api.post("save_weights_for_sampler", body).json()["request_id"]).json()
        assert first["path"].endswith("/sampler_weights/named"), first
        assert not (left / "half-written").exists() and any(left.glob("*.safetensors"))
        second = {**body, "seq_id": 2}
        refused = api.poll(api.post("save_weights_for_sampler", second).json()["request_id"])
        assert "exist already" in refused.json()["error"]
