"""The stream order releases jobs to the executor in fair turns by lane (a run): it runs one
ordered job at a time and waits for it, so were its released jobs first in, first out, a run with
many pipelined calls released would delay another run's next call by all of them. Counted in
jobs run, never in seconds; with one lane the order is first in, first out."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

from process_cluster import wait_until
from service_fixtures import TEXTS, microbatches

from trainwire.client import LoraSettings
from trainwire.contract.outcomes import OperationSpec
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import ForwardBackwardRequest
from trainwire.server.service.stream_order import SAMPLES_BESIDE, StreamOrder

BATCH = microbatches(TEXTS)[0]


def held(order: StreamOrder) -> threading.Event:
    """Keep the order's thread busy with a job of lane "hold" until the returned event is set,
    so everything submitted meanwhile is released before anything of it runs."""
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(60)

    order.start_stream("hold", lane="hold")
    order.submit("hold", 1, "hold", hold)
    running.wait(60)
    return gate


def release(order: StreamOrder, stream: str, lane: str, count: int, ran: list[str]) -> None:
    """``count`` jobs of ``stream`` (in ``lane``) in seq order; each notes its stream as it runs."""
    order.start_stream(stream, lane=lane)
    for seq in range(1, count + 1):
        assert order.submit(stream, seq, f"{stream}/{seq}", partial(ran.append, stream))


def drained(order: StreamOrder, gate: threading.Event) -> None:
    """Let the held order go, and wait until every job released has run."""
    gate.set()
    order.stop()
    order._thread.join(60)
    order._samples.wait()


def flood_then_one(weight_of: Callable[[str], float] | None, lanes: tuple[str, str]) -> list[str]:
    """Stream "a" (lane ``lanes[0]``) has 200 jobs released, then stream "b" (``lanes[1]``)
    one; the streams in the order their jobs ran."""
    order = StreamOrder(lambda job: job(), weight_of=weight_of)
    ran: list[str] = []
    gate = held(order)
    release(order, "a", lanes[0], 200, ran)
    release(order, "b", lanes[1], 1, ran)
    drained(order, gate)
    assert len(ran) == 201
    return ran


def test_a_stream_with_two_hundred_jobs_released_delays_another_lanes_job_by_one():
    assert flood_then_one(None, ("a", "b")).index("b") == 1


def test_a_lane_of_weight_two_delays_another_lanes_job_by_two():
    ran = flood_then_one(lambda lane: 2.0 if lane == "a" else 1.0, ("a", "b"))
    assert ran.index("b") == 2


def test_with_one_lane_the_order_is_first_in_first_out():
    assert flood_then_one(None, ("", "")).index("b") == 200


def test_one_lanes_unordered_jobs_delay_another_lanes_job_by_one_batch():
    """Lane "a" has 40 unordered jobs (samples) released, then lane "b" an ordered one: b runs
    after one turn of a's samples, started beside each other (a batch), not after all 40."""
    order = StreamOrder(lambda job: job())
    ran: list[str] = []
    gate = held(order)
    for _ in range(40):
        order.run_unordered(partial(ran.append, "a"), lane="a")
    release(order, "b", "b", 1, ran)
    drained(order, gate)
    assert len(ran) == 41
    assert ran.index("b") == SAMPLES_BESIDE < 40


def test_a_run_with_pipelined_calls_released_delays_another_runs_call_by_one_turn(
    make_host, llama_config
):
    """Run "flood" has 30 pipelined calls (expected positions 0..29) released in the order;
    run "other"'s one call, released after them, runs after one of them (counted in journal
    positions: one more may run while the other call's commit completes)."""
    host = make_host(max_runs=2)
    host._executor.max_queued = 64  # the 31 calls below wait at once
    host.idle_release_s = 600.0  # a call whose predecessor is late waits for it, however long
    lora = LoraSettings(r=4, alpha=8)
    host.open("flood", llama_config(lora=lora, lr_scheduler="constant"))
    host.open("other", llama_config(lora=lora, seed=7, lr_scheduler="constant"))
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:  # the order's next job waits for this one, so all below is released
        running.set()
        gate.wait(60)

    host.order.run_unordered(hold, lane="hold")
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
    assert wait_until(lambda: host.order._waiting["flood"].ready == 30)
    other = threading.Thread(target=forward_backward, args=("other", 0))
    other.start()
    assert wait_until(lambda: host.order._waiting["other"].ready == 1)
    gate.set()
    other.join(60)
    applied_before = host.info("flood").position  # as the other run's call returned
    for thread in flood:
        thread.join(60)
    assert not failures, failures
    assert host.info("other").position == 1 and host.info("flood").position == 30
    assert applied_before <= 2, applied_before
