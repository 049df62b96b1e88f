"""Runs computed together by the service: the scheduler takes the ready forward_backward calls of
several LoRA runs on one base as one pass over it (``shared_passes``), each run's results and
state digest the bits it gets alone, fair by lane, exactly once across a replay, a refusal and a
SIGKILL. Every test counts the shared passes (the scheduler's ``shared_passes`` and its log
of each pass's lanes), so it tells runs computed together from runs taking turns."""

from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from process_cluster import wait_until
from service_fixtures import TEXTS, connect, microbatches, running_server
from test_fair_turns import held
from test_pipelining import run_pipelined
from test_service_restart import TOKEN, ServeProcess

from trainwire.client import LoraSettings, SessionClient, TokenExample
from trainwire.contract.outcomes import OperationSpec
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import FailedPrecondition, InvalidArgument, PositionMismatch
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import (
    ForwardBackwardRequest,
    ForwardRequest,
    OptimStepRequest,
)

BATCHES = microbatches(TEXTS, size=4)
PLAIN_LORA = LoraSettings(r=4, alpha=8, dropout=0.0)
RUNS = ("r0", "r1", "r2", "r3")
# Every run trains on one stream of batches (a sweep over seeds): a step's batches have one width.
STEPS = [("fb", BATCHES[0]), ("fb", BATCHES[1]), ("step", None)] * 2
PASS_LOG = "trainwire.server.service.scheduler"


def run_configs(llama_config: Any) -> dict[str, Any]:
    return {
        name: llama_config(lora=PLAIN_LORA, seed=index + 1, lr_scheduler="constant")
        for index, name in enumerate(RUNS)
    }


def apply_steps(client: SessionClient, name: str, steps: list, *, first: int = 0) -> list[Any]:
    """``steps[first:]`` of run ``name``, pipelined, keys ``{name}/{index}``; their outcomes."""
    return run_pipelined(client, steps, name, first=first)


def alone_on_a_server(tmp_path, model_root, configs, steps) -> dict[str, tuple[list, str]]:
    """Each run's ``steps`` alone on a server of one run: its outcomes and final digest."""
    return alone_on_a_server_by(
        tmp_path, model_root, configs, lambda c, n: apply_steps(c, n, steps)
    )


def alone_on_a_server_by(tmp_path, model_root, configs, train) -> dict[str, tuple[list, str]]:
    """``train(client, name)`` for each run alone on a server of one run (a client each: a
    pipeline numbers from its run's position): its outcomes and final digest."""
    alone = {}
    with running_server(tmp_path / "alone", model_root) as server:
        for name, config in configs.items():
            with connect(server) as client:
                client.open(name, config)
                alone[name] = (train(client, name), client.info().state_digest)
                client.close()
    return alone


@pytest.fixture
def passes(caplog) -> Iterator[list[list[str]]]:
    """The lanes of every shared pass, in the order they ran (the scheduler logs each)."""
    caplog.set_level(logging.DEBUG, logger=PASS_LOG)
    found: list[list[str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg.startswith("one pass of"):
                found.append(list(record.args[1]))

    handler = Collect()
    logging.getLogger(PASS_LOG).addHandler(handler)
    yield found
    logging.getLogger(PASS_LOG).removeHandler(handler)


def test_four_runs_pipelined_over_grpc_share_passes_and_each_ends_as_alone(
    tmp_path, model_root, llama_config, passes
):
    configs = run_configs(llama_config)
    alone = alone_on_a_server(tmp_path, model_root, configs, STEPS)
    with running_server(tmp_path / "together", model_root, max_runs=4) as server:
        scheduler = server.session_host.scheduler
        clients = {name: connect(server, max_in_flight=2) for name in RUNS}
        for name, config in configs.items():
            clients[name].open(name, config)
        release = held(scheduler).set
        results: dict[str, list] = {}
        threads = [
            threading.Thread(
                target=lambda name=name: results.update(
                    {name: apply_steps(clients[name], name, STEPS)}
                )
            )
            for name in RUNS
        ]
        for thread in threads:
            thread.start()
        # The hold, and each run's first two calls: the first ready, the second held behind it.
        assert wait_until(lambda: scheduler.queued == 1 + 2 * len(RUNS), 60)
        release()
        for thread in threads:
            thread.join(300)
        for name, client in clients.items():
            assert results[name] == alone[name][0], name
            assert client.info().state_digest == alone[name][1], name
            client.close_channel()
        assert sorted(passes[0]) == sorted(RUNS)  # the four first calls: one pass
        assert scheduler.shared_passes == len(passes) >= 1
        assert scheduler.shared_jobs == sum(len(lanes) for lanes in passes)


def forward_backward_thread(host, run_id: str, key: str, batch, **spec: Any) -> threading.Thread:
    """A thread applying one forward_backward; its outcome (or error) lands in ``thread.result``."""

    def call() -> None:
        try:
            request = ForwardBackwardRequest(batch)
            thread.result = host.apply(
                ops.FORWARD_BACKWARD, request, OperationSpec(key, **spec), run_id=run_id
            )
        except Exception as error:
            thread.result = error

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def forward_backwards_queued_together(host, batches: dict[str, Any]) -> dict[str, threading.Thread]:
    """One forward_backward of each run (key ``{run}/0``), all queued behind a held engine
    before it is released, so the scheduler sees every one ready at once; joined."""
    release = held(host.scheduler).set
    threads = {
        name: forward_backward_thread(host, name, f"{name}/0", batch)
        for name, batch in batches.items()
    }
    assert wait_until(lambda: host.scheduler.queued == 1 + len(batches), 60)
    release()
    for thread in threads.values():
        thread.join(120)
    return threads


def test_a_run_with_many_waiting_calls_gets_one_job_a_pass_and_shares_stay_even(
    make_host, llama_config, passes
):
    host = make_host(max_runs=4)
    for name, config in run_configs(llama_config).items():
        host.open(name, config)
    scheduler = host.scheduler

    # r0 floods: 20 calls; the three others one each, sent after the flood.
    release = held(scheduler).set
    threads = [forward_backward_thread(host, "r0", f"r0/{i}", BATCHES[0]) for i in range(20)]
    assert wait_until(lambda: scheduler.queued == 21, 60)
    threads += [forward_backward_thread(host, name, f"{name}/0", BATCHES[0]) for name in RUNS[1:]]
    assert wait_until(lambda: scheduler.queued == 24, 60)
    release()
    for thread in threads:
        thread.join(300)
    assert all(not isinstance(thread.result, Exception) for thread in threads)
    assert sorted(passes[0]) == sorted(RUNS)  # the others' one call each rode r0's first turn
    assert passes == [passes[0]]  # r0's other 19 ran alone: no run has two jobs in a pass
    assert [host.info(name).position for name in RUNS] == [20, 1, 1, 1]

    # Every run with five calls waiting: five passes, each run in each once.
    passes.clear()
    release = held(scheduler).set
    threads = [
        forward_backward_thread(host, name, f"{name}/more/{i}", BATCHES[0])
        for i in range(5)
        for name in RUNS
    ]
    assert wait_until(lambda: scheduler.queued == 21, 60)
    release()
    for thread in threads:
        thread.join(300)
    assert all(not isinstance(thread.result, Exception) for thread in threads)
    assert all(sorted(lanes) == sorted(RUNS) for lanes in passes), passes
    shares = Counter(lane for lanes in passes for lane in lanes)
    assert shares == {name: 5 for name in RUNS}


def test_forward_reads_of_several_runs_share_a_pass_and_read_what_they_read_alone(
    make_host, llama_config, passes
):
    host = make_host(max_runs=3)
    names = RUNS[:3]
    for name, config in list(run_configs(llama_config).items())[:3]:
        host.open(name, config)
        fb, step = ForwardBackwardRequest(BATCHES[1]), OptimStepRequest()
        host.apply(ops.FORWARD_BACKWARD, fb, OperationSpec(f"{name}/0"), run_id=name)
        host.apply(ops.OPTIM_STEP, step, OperationSpec(f"{name}/1"), run_id=name)

    def read(name: str) -> Any:
        return host.apply(ops.FORWARD, ForwardRequest(BATCHES[0]), run_id=name)

    release = held(host.scheduler).set
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda name=name: results.update({name: read(name)}))
        for name in names
    ]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: host.scheduler.queued == 1 + len(names), 60)
    release()
    for thread in threads:
        thread.join(120)
    assert [sorted(lanes) for lanes in passes] == [sorted(names)]
    for name in names:  # one at a time: each alone
        assert read(name) == results[name], name
    assert len(passes) == 1


def alone_digest(config, batches: list) -> tuple[list[float], str]:
    """The run trained in this process alone: its losses and state digest."""
    session = TrainingSession(config)
    losses = [session.forward_backward(batch) for batch in batches]
    return losses, session.state_digest()


def test_a_replayed_key_and_a_stale_position_beside_a_pass_are_answered_alone(
    make_host, llama_config, passes
):
    host = make_host(max_runs=4)
    configs = run_configs(llama_config)
    for name, config in configs.items():
        host.open(name, config)
    r0, r1 = (forward_backward_thread(host, name, f"{name}/0", BATCHES[0]) for name in RUNS[:2])
    for thread in (r0, r1):
        thread.join(120)
    first_r0 = r0.result
    assert host.scheduler.shared_passes == 0 or sorted(passes[0]) == ["r0", "r1"]
    passes.clear()
    before = host.scheduler.shared_passes

    release = held(host.scheduler).set
    r2 = forward_backward_thread(host, "r2", "r2/0", BATCHES[0])  # its turn comes first
    assert wait_until(lambda: host.scheduler.queued == 2, 60)
    replay = forward_backward_thread(host, "r0", "r0/0", BATCHES[0])
    stale = forward_backward_thread(host, "r1", "r1/1", BATCHES[0], expected_position=0)
    r3 = forward_backward_thread(host, "r3", "r3/0", BATCHES[0])
    assert wait_until(lambda: host.scheduler.queued == 5, 60)
    release()
    for thread in (r2, replay, stale, r3):
        thread.join(120)
    assert passes == [["r2", "r3"]] and host.scheduler.shared_passes == before + 1
    assert replay.result.replayed and replay.result.loss == first_r0.loss
    assert isinstance(stale.result, PositionMismatch)
    assert [host.info(name).position for name in RUNS] == [1, 1, 1, 1]
    for name in ("r2", "r3"):
        losses, digest = alone_digest(configs[name], [BATCHES[0]])
        assert host.info(name).state_digest == digest
        assert [(r2 if name == "r2" else r3).result.loss] == losses


def token_batch(last: int) -> list[TokenExample]:
    """Four cross-entropy sequences of 8 tokens (32 positions: enough to stack on this CPU)."""
    return [TokenExample.from_sequence([5, 9, 14, 3, 7, 21, 4, seed, last]) for seed in range(4)]


def test_a_request_its_run_refuses_is_left_out_of_the_pass_and_only_it_fails(
    make_host, llama_config, passes
):
    """A token batch's ids are checked against the vocabulary when the engine encodes it, which
    grouping does (each request is encoded once): the refused request runs alone and meets its
    error, the others share the pass."""
    configs = dict(list(run_configs(llama_config).items())[:3])
    host = make_host(max_runs=3)
    for name, config in configs.items():
        host.open(name, config)
    batches = {"r0": token_batch(2), "r1": token_batch(10**6), "r2": token_batch(2)}
    threads = forward_backwards_queued_together(host, batches)
    assert passes == [["r0", "r2"]]
    assert isinstance(threads["r1"].result, InvalidArgument)
    assert [host.info(name).position for name in configs] == [1, 0, 1]
    for name in ("r0", "r2"):
        losses, digest = alone_digest(configs[name], [batches[name]])
        assert threads[name].result.loss == losses[0].loss
        assert host.info(name).state_digest == digest


def test_a_pass_its_engine_refuses_runs_each_alone_and_only_the_refused_one_fails(
    make_host, llama_config, passes, caplog
):
    """A run whose session a failed backward left unusable still joins a pass (its key is
    fresh); the pass refuses before any session changed, so each job runs alone at its turn: the
    others end as alone, the broken run meets its own FailedPrecondition and fails alone (a
    restart restores it from its latest checkpoint); the others go on serving."""
    caplog.set_level(logging.INFO, logger="trainwire.server.service.shared_passes")
    configs = dict(list(run_configs(llama_config).items())[:3])
    host = make_host(max_runs=3)
    for name, config in configs.items():
        host.open(name, config)
    broken = host._runs["r2"].session
    with pytest.raises(RuntimeError), broken.breaks_on_failure("a backward"):
        raise RuntimeError("a kernel failed")
    batches = {name: token_batch(2) for name in configs}
    threads = forward_backwards_queued_together(host, batches)
    assert "a shared pass of 3 runs was refused" in caplog.text
    assert passes == []  # every call ran alone
    assert isinstance(threads["r2"].result, FailedPrecondition)
    assert "unusable" in str(threads["r2"].result)
    assert host.info("r2").state == "failed"
    with pytest.raises(FailedPrecondition, match="restart the server to restore; the other runs"):
        host.apply(ops.OPTIM_STEP, OptimStepRequest(), OperationSpec("r2/step"), run_id="r2")
    for name in ("r0", "r1"):
        losses, digest = alone_digest(configs[name], [batches[name]])
        assert threads[name].result.position == 1
        assert threads[name].result.loss == losses[0].loss
        assert host._runs[name].session.state_digest() == digest
        assert host.info(name).state == "open"
        stepped = host.apply(
            ops.OPTIM_STEP, OptimStepRequest(), OperationSpec(f"{name}/step"), run_id=name
        )
        assert stepped.position == 2  # the other runs serve on


def test_runs_that_cannot_share_take_turns_and_still_end_as_alone(make_host, llama_config, passes):
    configs = {
        "plain-a": llama_config(lora=PLAIN_LORA, seed=1),
        "plain-b": llama_config(lora=PLAIN_LORA, seed=2),
        "dropout": llama_config(lora=LoraSettings(r=4, alpha=8, dropout=0.1), seed=3),
        "other-targets": llama_config(
            lora=LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj")), seed=4
        ),
    }
    host = make_host(max_runs=4)
    for name, config in configs.items():
        host.open(name, config)
    threads = forward_backwards_queued_together(host, {name: BATCHES[0] for name in configs})
    assert [sorted(lanes) for lanes in passes] == [["plain-a", "plain-b"]]
    for name, config in configs.items():
        losses, digest = alone_digest(config, [BATCHES[0]])
        assert [threads[name].result.loss] == losses, name
        assert host.info(name).state_digest == digest, name


@pytest.mark.slow
def test_runs_together_killed_after_a_checkpoint_replay_to_the_bits_of_alone(
    tmp_path, model_root, llama_config
):
    """Four runs on a ``trainwire serve --max-runs 4`` process train together, each saves a
    checkpoint, trains on, and the process is SIGKILLed; restarted, each run is back at its
    checkpoint and the same calls, sent again together, end every run as alone."""
    configs = run_configs(llama_config)
    steps = [*STEPS, ("fb", BATCHES[2])]

    def uninterrupted(client: SessionClient, name: str) -> list[Any]:
        apply_steps(client, name, steps[:3])
        client.save_state("c1", operation_key=f"{name}/save", expected_position=3)
        return apply_steps(client, name, steps, first=3)

    alone = alone_on_a_server_by(tmp_path, model_root, configs, uninterrupted)
    state_dir = tmp_path / "state"
    extra = ("--max-runs", "4")
    first = ServeProcess(tmp_path, state_dir, model_root, "first", extra=extra)
    try:
        clients = {name: connect(first.port, token=TOKEN, max_in_flight=2) for name in RUNS}
        for name, config in configs.items():
            clients[name].open(name, config)
        together(lambda name: uninterrupted(clients[name], name))
        for client in clients.values():
            client.close_channel()
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    finally:
        first.kill_if_running()

    second = ServeProcess(tmp_path, state_dir, model_root, "second", extra=extra)
    try:
        clients = {name: connect(second.port, token=TOKEN, max_in_flight=2) for name in RUNS}
        results: dict[str, list] = {}

        def after_the_restart(name: str) -> None:
            clients[name].open(name, configs[name])  # reattaches to the restored run
            assert clients[name].info().position == 4
            results[name] = apply_steps(clients[name], name, steps, first=3)

        together(after_the_restart)
        for name, client in clients.items():
            assert not any(outcome.replayed for outcome in results[name]), name  # rolled back
            assert results[name] == alone[name][0], name
            assert client.info().state_digest == alone[name][1], name
            client.close_channel()
        assert second.stop(signal.SIGTERM) == 0
    finally:
        second.kill_if_running()


def together(train: Callable[[str], None]) -> None:
    """``train(name)`` for every run at once, each on its own thread; re-raises a failure."""
    errors: list[BaseException] = []

    def guarded(name: str) -> None:
        try:
            train(name)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(name,)) for name in RUNS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    if errors:
        raise errors[0]
