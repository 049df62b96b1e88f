"""The client's retry on DEADLINE_EXCEEDED against a real server that is slow: the first try's
deadline passes while the server still runs it, the retry carries the same operation key, and the
operation is applied once; the caller gets the result the journal recorded."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from service_fixtures import FAST_RETRY, TEXTS, connect, running_server, wait_for

DEADLINE_S = 2.0  # each try's deadline: the held operation outlasts it


def test_a_call_past_its_deadline_on_a_slow_server_is_retried_and_applied_once(
    tmp_path, model_root, llama_config
):
    with running_server(tmp_path / "state", model_root) as handle:
        host = handle.session_host
        client = connect(handle, retry=FAST_RETRY, timeout_s=DEADLINE_S)
        client.open("run", llama_config())
        session = host.session
        release, real = threading.Event(), session.forward_backward
        calls: list[int] = []

        def slow(examples, **loss):  # the first one runs only once the client has retried
            calls.append(len(calls))
            if len(calls) == 1:
                assert release.wait(120), "the test never released the slow operation"
            return real(examples, **loss)

        session.forward_backward = slow
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(client.forward_backward, TEXTS[:2], operation_key="slow")
            # The first try's deadline passed and its retry waits behind the running original
            # (both admitted: ``waiting`` counts the running call too).
            wait_for(lambda: host.scheduler.waiting == 2, 60)
            release.set()
            outcome = call.result(timeout=120)
        assert outcome.position == 1 and calls == [0]  # the engine ran it once
        entries = host.journal.entries()
        assert [(e.operation_key, e.position) for e in entries] == [("slow", 1)]
        assert client.info().position == 1
        client.close_channel()
