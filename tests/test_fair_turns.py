"""The scheduler serves lanes (runs) with work in turns: a lane that floods it never delays another
lane's next call by more than one call of each other lane with work (times its weight), measured
in calls run, never in seconds. With one lane it is first in, first out."""

from __future__ import annotations

import threading
from collections.abc import Callable

from process_cluster import wait_until

from trainwire.server.service.fair_turns import FairTurns
from trainwire.server.service.scheduler import Scheduler


def held(scheduler: Scheduler) -> threading.Event:
    """Keep the scheduler's thread busy until the returned event is set, so what is queued
    meanwhile waits and the order it then runs in is the scheduler's choice alone."""
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(60)

    threading.Thread(target=scheduler.run, args=(hold,), kwargs={"lane": "hold"}).start()
    running.wait(60)
    return gate


def queue(scheduler: Scheduler, lane: str, ran: list[str], count: int) -> list[threading.Thread]:
    """``count`` calls of ``lane``, queued in order; each notes its lane in ``ran`` as it runs."""
    threads = []
    for _ in range(count):
        queued = threading.Event()

        def call(lane: str = lane) -> None:
            ran.append(lane)

        def submit(call: Callable[[], None] = call, queued: threading.Event = queued) -> None:
            queued.set()
            scheduler.run(call, lane=lane)

        thread = threading.Thread(target=submit)
        thread.start()
        queued.wait(60)
        threads.append(thread)
    return threads


def wait_queued(scheduler: Scheduler, count: int) -> None:
    """Until ``count`` calls are queued behind the held one (the submitting threads raced)."""
    assert wait_until(lambda: scheduler.queued >= count + 1), "the calls never queued"


def test_a_flooding_run_delays_another_runs_calls_by_one_call_each():
    scheduler = Scheduler(max_queued=1000)
    ran: list[str] = []
    gate = held(scheduler)
    threads = queue(scheduler, "flood", ran, 200)
    wait_queued(scheduler, 200)
    threads += queue(scheduler, "other", ran, 5)
    threads += queue(scheduler, "third", ran, 3)
    wait_queued(scheduler, 208)
    gate.set()
    for thread in threads:
        thread.join(60)
    assert len(ran) == 208
    # Each of "other"'s calls waited for at most one call of each other lane with work.
    previous = -1
    for index in [i for i, lane in enumerate(ran) if lane == "other"]:
        between = ran[previous + 1 : index]
        assert between.count("flood") <= 1 and between.count("third") <= 1, ran[:20]
        previous = index
    assert ran[:8] == ["flood", "other", "third"] * 2 + ["flood", "other"]
    scheduler.release(lambda: None)


def test_a_lane_of_weight_two_runs_two_calls_a_turn():
    scheduler = Scheduler(max_queued=1000, weight_of=lambda lane: 2.0 if lane == "a" else 1.0)
    ran: list[str] = []
    gate = held(scheduler)
    threads = queue(scheduler, "a", ran, 6) + queue(scheduler, "b", ran, 6)
    wait_queued(scheduler, 12)
    gate.set()
    for thread in threads:
        thread.join(60)
    assert ran == ["a", "a", "b"] * 3 + ["b"] * 3
    scheduler.release(lambda: None)


def test_one_lane_is_first_in_first_out_and_release_runs_after_everything_queued():
    scheduler = Scheduler()
    ran: list[str] = []
    gate = held(scheduler)
    threads = queue(scheduler, "", ran, 5)
    wait_queued(scheduler, 5)
    idle = threading.Thread(target=lambda: ran.append(f"idle={scheduler.wait_idle(60)}"))
    idle.start()
    gate.set()
    for thread in [*threads, idle]:
        thread.join(60)
    assert ran == [""] * 5 + ["idle=True"]
    scheduler.release(lambda: ran.append("released"))
    assert ran[-1] == "released"


def test_a_weight_that_cannot_be_read_counts_as_one_and_the_executor_goes_on():
    def weight_of(lane: str) -> float:
        raise ValueError(f"no weight for {lane!r}")

    scheduler = Scheduler(weight_of=weight_of)
    assert scheduler.run(lambda: "ran", lane="") == "ran"
    assert scheduler.run(lambda: "again", lane="other") == "again"
    scheduler.release(lambda: None)


def test_an_item_taken_before_its_lanes_turn_spends_that_turn():
    """A pass shared by several lanes takes the other lanes' heads out of turn: each such lane's
    next turn is spent by it, so it gives no more items than its turns."""
    turns: FairTurns[str] = FairTurns()
    for lane in "abc":
        for index in range(3):
            turns.put(lane, f"{lane}{index}")
    assert turns.take() == "a0"
    assert turns.heads_after("a") == [("b", "b0"), ("c", "c0")]
    assert turns.take_out_of_turn("c") == "c0"  # rides with a0: c's next turn is spent
    assert [turns.take() for _ in range(7)] == ["b0", "a1", "b1", "c1", "a2", "b2", "c2"]
    assert turns.take() is None
