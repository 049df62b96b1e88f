"""The scheduler takes the ready jobs of numbered streams in fair turns by lane (a run): were
they first in, first out, a run with many pipelined calls released would delay another run's next
call by all of them. Counted in jobs run, never in seconds; with one lane the order is first in,
first out. A lane's samples at its head take one turn together, as one batch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from process_cluster import wait_until
from sample_requests import prompts
from service_fixtures import TEXTS, microbatches

from trainwire.client import LoraSettings
from trainwire.contract.outcomes import OperationSpec
from trainwire.server.engine.session import TrainingSession
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import ForwardBackwardRequest, SampleRequest
from trainwire.server.service.scheduler import Scheduler

BATCH = microbatches(TEXTS)[0]


def held(scheduler: Scheduler) -> threading.Event:
    """Keep the engine thread busy with a job of lane "hold" until the returned event is set,
    so everything submitted meanwhile is ready before anything of it runs."""
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(60)

    scheduler.start_stream("hold", lane="hold")
    scheduler.submit("hold", 1, "hold", hold)
    running.wait(60)
    return gate


def release(scheduler: Scheduler, stream: str, lane: str, count: int, ran: list[str]) -> None:
    """``count`` jobs of ``stream`` (in ``lane``) in seq order; each notes its stream as it runs."""
    scheduler.start_stream(stream, lane=lane)
    for seq in range(1, count + 1):
        assert scheduler.submit(stream, seq, f"{stream}/{seq}", partial(ran.append, stream))


def drained(scheduler: Scheduler, gate: threading.Event) -> None:
    """Let the held engine go, and wait until every job made ready has run."""
    gate.set()
    scheduler.release(lambda: None)


def flood_then_one(weight_of: Callable[[str], float] | None, lanes: tuple[str, str]) -> list[str]:
    """Stream "a" (lane ``lanes[0]``) has 200 jobs released, then stream "b" (``lanes[1]``)
    one; the streams in the order their jobs ran."""
    scheduler = Scheduler(weight_of=weight_of)
    ran: list[str] = []
    gate = held(scheduler)
    release(scheduler, "a", lanes[0], 200, ran)
    release(scheduler, "b", lanes[1], 1, ran)
    drained(scheduler, gate)
    assert len(ran) == 201
    return ran


def test_a_stream_with_two_hundred_jobs_released_delays_another_lanes_job_by_one():
    assert flood_then_one(None, ("a", "b")).index("b") == 1


def test_a_lane_of_weight_two_delays_another_lanes_job_by_two():
    ran = flood_then_one(lambda lane: 2.0 if lane == "a" else 1.0, ("a", "b"))
    assert ran.index("b") == 2


def test_with_one_lane_the_order_is_first_in_first_out():
    assert flood_then_one(None, ("", "")).index("b") == 200


def test_one_runs_samples_delay_another_runs_job_by_one_batch(make_host, llama_config, monkeypatch):
    """Run "a" has 12 samples queued, then run "b" a job: b runs after one turn of a's samples,
    decoded as one batch on the engine thread, not after 12 turns."""
    host = make_host(max_runs=2)
    lora = LoraSettings(r=4, alpha=8)
    host.open("a", llama_config(lora=lora))
    host.open("b", llama_config(lora=lora, seed=7))
    ran: list[str] = []
    inner = TrainingSession.sample_many

    def noted(session, selected, requests, join):
        inner(session, selected, requests, join)
        ran.append(f"batch of {len(requests)} on {threading.current_thread().name}")

    monkeypatch.setattr(TrainingSession, "sample_many", noted)
    scheduler = host.scheduler
    gate = held(scheduler)
    prompt = prompts(host._runs["a"].session.sampler.vocab_size)[0]
    samples = [SampleRequest(prompt, max_tokens=2, seed=seed) for seed in range(12)]
    threads = [
        threading.Thread(target=host.apply, args=(ops.SAMPLE, r), kwargs={"run_id": "a"})
        for r in samples
    ]
    for thread in threads:
        thread.start()
    assert wait_until(lambda: scheduler.queued == 1 + len(samples))  # the hold and a's
    threads.append(
        threading.Thread(
            target=scheduler.run, args=(partial(ran.append, "b"),), kwargs={"lane": "b"}
        )
    )
    threads[-1].start()
    assert wait_until(lambda: scheduler.queued == 2 + len(samples))
    gate.set()
    for thread in threads:
        thread.join(60)
    assert ran == [f"batch of {len(samples)} on trainwire-engine", "b"]  # no thread of their own


def test_a_run_with_pipelined_calls_released_delays_another_runs_call_by_one_turn(
    make_host, llama_config
):
    """Run "flood" has 30 pipelined calls (expected positions 0..29) made ready;
    run "other"'s one call, released after them, runs after one of them (counted in journal
    positions: one more may run while the other call's commit completes)."""
    host = make_host(max_runs=2)
    host.scheduler.max_queued = 64  # the 31 calls below wait at once
    host.idle_release_s = 600.0  # a call whose predecessor is late waits for it, however long
    lora = LoraSettings(r=4, alpha=8)
    host.open("flood", llama_config(lora=lora, lr_scheduler="constant"))
    host.open("other", llama_config(lora=lora, seed=7, lr_scheduler="constant"))
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:  # the engine's next job waits for this one, so all below is ready
        running.set()
        gate.wait(60)

    threading.Thread(target=host.scheduler.run, args=(hold,), kwargs={"lane": "hold"}).start()
    running.wait(60)
    failures: list[BaseException] = []

    def forward_backward(run_id: str, position: int) -> None:
        spec = OperationSpec(f"{run_id}/{position}", expected_position=position)
        try:
            host.apply(ops.FORWARD_BACKWARD, ForwardBackwardRequest(BATCH), spec, run_id=run_id)
        except BaseException as error:
            failures.append(error)

    flood = [threading.Thread(target=forward_backward, args=("flood", p)) for p in range(30)]
    for thread in flood:
        thread.start()
    assert wait_until(lambda: host.scheduler._counts["flood"].ready == 30)
    other = threading.Thread(target=forward_backward, args=("other", 0))
    other.start()
    assert wait_until(lambda: host.scheduler._counts["other"].ready == 1)
    gate.set()
    other.join(60)
    applied_before = host.info("flood").position  # as the other run's call returned
    for thread in flood:
        thread.join(60)
    assert not failures, failures
    assert host.info("other").position == 1 and host.info("flood").position == 30
    assert applied_before <= 2, applied_before
