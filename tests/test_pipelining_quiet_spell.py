"""A pipelined call that overtakes its predecessor after a quiet spell waits for it.

The server lets a call held for its position go (to be refused with the real position) once
nothing has run for ``idle_release_s``: its predecessor may never come. That idle time was
counted from the last call that ran, so after a quiet spell (a run opening and loading its model,
a controller evaluating) a call arriving a moment before its predecessor was let go at once and
refused, and an uninterrupted ``trainwire run`` warned "expected_position 1, but the session is
at position 0 ... resynchronizing" (7 runs in 20 against one server, before the fix).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import grpc
import pytest
from service_fixtures import NO_RETRY, TEXTS, connect, microbatches, running_server, wait_for

from trainwire.client import ManagedTrainingPlan, TrainingConfig
from trainwire.client.control.controller import Controller
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_text_examples

RUNS = 8  # uninterrupted runs of the controller, one after another, on one server


def test_a_call_arriving_before_its_predecessor_after_a_quiet_spell_waits_for_it(
    tmp_path: Path, model_root: Path, llama_config
) -> None:
    config = llama_config(lr_scheduler="constant")
    first, second = microbatches(TEXTS[:6])
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle, retry=NO_RETRY)
        host = handle.session_host
        client.open("run", config)
        time.sleep(host.idle_release_s * 1.5)  # quiet: nothing runs (a model loading, say)
        results: dict[str, object] = {}

        def send_second() -> None:
            try:
                results["second"] = client.forward_backward(
                    second, operation_key="b", expected_position=1
                )
            except grpc.RpcError as error:
                results["second"] = error.code()

        thread = threading.Thread(target=send_second)
        thread.start()  # position 1 goes first; the session is at 0
        wait_for(lambda: host.scheduler.waiting == 1 or "second" in results, 60)
        assert "second" not in results  # held for its predecessor, not let go to be refused
        results["first"] = client.forward_backward(first, operation_key="a", expected_position=0)
        thread.join(timeout=60)
        entries = host.journal.entries()
        digest = client.info().state_digest
        client.close_channel()
    local = TrainingSession(config, device="cpu")
    local.forward_backward(first)
    local.forward_backward(second)
    assert [(e.operation_key, e.position) for e in entries] == [("a", 1), ("b", 2)]
    assert digest == local.state_digest()


@pytest.mark.slow
def test_uninterrupted_controller_runs_never_resynchronize(
    tmp_path: Path, model_root: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = TrainingConfig(
        model="llama", batch_size=2, gradient_accumulation_steps=1, num_epochs=1, seed=3
    )
    manifest = ManagedTrainingPlan(tiny_text_examples(8, seed=3), config).to_manifest()
    digests = set()
    with (
        caplog.at_level(logging.WARNING, logger="trainwire.client.control.controller"),
        running_server(tmp_path / "state", model_root) as handle,
    ):
        for run in range(RUNS):
            # Started a while after the last run ended: the server was quiet when it opens.
            time.sleep(handle.session_host.idle_release_s * 1.25)
            client = connect(handle)
            work_dir = tmp_path / f"work-{run}"
            controller = Controller(client, manifest, run_id=f"run-{run}", work_dir=work_dir)
            digests.add(controller.run().state_digest)
            client.close_channel()
    assert [r.getMessage() for r in caplog.records if "resynchroniz" in r.getMessage()] == []
    assert len(digests) == 1  # the same plan, the same bits every time
