"""LoRA runs computed together by a server: 8 runs driven by 8 gRPC clients at once against one
run alone on the same server, total steps per second (``bench/runs_together.py --service``).

One ``serve(max_runs=N + 1)`` on loopback, in this process; each run's client in a process of
its own, as users' clients are (``ClientProcess``; ``client_threads``: on a thread of this one,
where its Python work waits for the server's interpreter lock and the server's for its),
pipelining its run's calls (``forward_backward_async`` then ``optim_step_async`` a step, two
on the wire: 8 clients' windows stay within the calls one key may have waiting). Every run
trains on the same 4 texts a step (a sweep over seeds and adapters), so the runs' ready
``forward_backward`` calls have one width and the scheduler may take them as one pass
(``shared_passes``).

- ``alone``: run ``alone`` (seed 0), its steps back to back, the other runs idle;
- ``together``: runs ``run-0`` .. ``run-{N-1}`` (seeds 0..N-1), all stepping at once.

Alone and together take turns, round by round, so both see the same machine; the line gives the
medians over the rounds, the passes the server shared (with the runs in them), and how evenly the
runs went (issue 45: shares within 10 %): in the worst round, the time the first run took for its
steps as a fraction of the time the last run took (every run has its calls waiting throughout,
so fair turns keep it near 1). Every run's state digest is then checked equal to the same run
trained alone in this process, step for step.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from pathlib import Path
from typing import Any

IN_FLIGHT = 2  # calls each client pipelines


def step_texts(step: int) -> list:
    from trainwire.testing import tiny_text_examples

    return tiny_text_examples(4, seed=step)


def train(client: Any, name: str, steps: range) -> float:
    """Steps ``steps`` of run ``name``, pipelined; returns once every one has applied, with
    when (``time.perf_counter``: one clock for every process of the machine)."""
    calls = []
    for step in steps:
        calls.append(
            client.forward_backward_async(step_texts(step), operation_key=f"{name}/{step}")
        )
        calls.append(client.optim_step_async(operation_key=f"{name}/{step}/step"))
    for call in calls:
        call.result()
    return time.perf_counter()


class ClientProcess:
    """Run ``name``'s client in a process of its own, as a user's client is: its Python work
    (building requests, pipelining them) never waits for the server's interpreter lock, nor
    the server's for its."""

    def __init__(self, target: str, name: str, config: Any) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process running gRPC
        self._commands, theirs = context.Pipe()
        self._process = context.Process(
            target=serve_client, args=(target, name, config, theirs), daemon=True
        )
        self._process.start()

    def start(self, steps: range) -> None:
        self._commands.send((steps.start, steps.stop))

    def finished_at(self) -> float:
        answer = self._commands.recv()
        if isinstance(answer, str):
            raise RuntimeError(f"a client process failed: {answer}")
        return answer

    def close(self) -> None:
        self._commands.send(None)
        self._process.join(60)


def serve_client(target: str, name: str, config: Any, commands: Any) -> None:
    """A client process: train the windows of steps it is sent, answering when each ended."""
    from trainwire.client import SessionClient

    client = SessionClient(target, max_in_flight=IN_FLIGHT)
    client.open(name, config)  # the run is open: this binds the client to it
    try:
        while (window := commands.recv()) is not None:
            try:
                commands.send(train(client, name, range(*window)))
            except Exception as error:  # the bench's parent reports it
                commands.send(f"{type(error).__name__}: {error}")
    finally:
        client.close_channel()


class ClientThread:
    """Run ``name``'s client on a thread of the bench's (and the server's) process."""

    def __init__(self, target: str, name: str, config: Any) -> None:
        from trainwire.client import SessionClient

        self._client, self._name = SessionClient(target, max_in_flight=IN_FLIGHT), name
        self._client.open(name, config)  # the run is open: this binds the client to it
        self._finished: list[float] = []
        self._thread: threading.Thread | None = None

    def start(self, steps: range) -> None:
        def run() -> None:
            self._finished.append(train(self._client, self._name, steps))

        self._thread = threading.Thread(target=run)
        self._thread.start()

    def finished_at(self) -> float:
        assert self._thread is not None
        self._thread.join()
        return self._finished.pop()

    def close(self) -> None:
        self._client.close_channel()


def timed(clients: dict[str, Any], steps: range) -> tuple[float, float]:
    """Steps per second of every run in ``clients`` stepping ``steps`` at once, in all, and
    the runs' shares: the first run to finish its steps took this fraction of the time the last
    one took (1.0: every run went at one pace; each had its steps waiting throughout)."""
    started = time.perf_counter()
    for client in clients.values():
        client.start(steps)
    elapsed = [client.finished_at() - started for client in clients.values()]
    return len(clients) * len(steps) / max(elapsed), min(elapsed) / max(elapsed)


def alone_digest(config: Any, device: str, steps: int) -> str:
    """The run trained in this process alone, ``steps`` steps: its state digest."""
    from trainwire.server.engine.session import TrainingSession

    session = TrainingSession(config, device=device)
    for step in range(steps):
        session.forward_backward(step_texts(step))
        session.optim_step()
    return session.state_digest()


def measure_service(
    tmp: Path,
    model: Path,
    configure,
    device: str,
    runs: int,
    steps: int,
    rounds: int,
    *,
    client_threads: bool = False,
) -> dict[str, Any]:
    """Steps per second alone and together in each round, the passes shared, and whether every
    run's digest equals its digest alone. ``configure(seed)``: a run's config. Each run's
    client runs in a process of its own, or with ``client_threads`` on a thread of this one."""
    from trainwire.client import SessionClient
    from trainwire.server import serve

    handle = serve(
        listen="127.0.0.1:0",
        state_dir=tmp / "state",
        model_root=model.parent,
        device=device,
        max_runs=runs + 1,
    )
    try:
        scheduler = handle.session_host.scheduler
        target = f"127.0.0.1:{handle.port}"
        names = {"alone": 0} | {f"run-{seed}": seed for seed in range(runs)}
        opener = SessionClient(target)
        for name, seed in names.items():
            opener.open(name, configure(seed))
        kind = ClientThread if client_threads else ClientProcess
        clients = {name: kind(target, name, configure(seed)) for name, seed in names.items()}
        alone = {"alone": clients.pop("alone")}
        # Lazy imports, the first kernels and the row invariance probe, untimed.
        timed(alone, range(1))
        timed(clients, range(1))
        passes, jobs = scheduler.shared_passes, scheduler.shared_jobs
        alone_rates, together_rates, shares = [], [], []
        for round_ in range(rounds):
            window = range(1 + round_ * steps, 1 + (round_ + 1) * steps)
            alone_rates.append(timed(alone, window)[0])
            rate, share = timed(clients, window)
            together_rates.append(rate)
            shares.append(share)
        passes, jobs = scheduler.shared_passes - passes, scheduler.shared_jobs - jobs
        for client in [*alone.values(), *clients.values()]:
            client.close()
        digests = {}
        for name, seed in names.items():
            opener.open(name, configure(seed))
            digests[name] = opener.info().state_digest
        opener.close_channel()
    finally:
        handle.stop()
    trained = 1 + rounds * steps
    equal = [
        digests[name] == alone_digest(configure(seed), device, trained)
        for name, seed in names.items()
    ]
    return {
        "alone": alone_rates,
        "together": together_rates,
        "shares": shares,
        "passes": passes,
        "jobs": jobs,
        "fb_calls": runs * rounds * steps,
        "equal": equal,
    }


def report(figures: dict[str, Any], runs: int, goal: float | None) -> str:
    alone, together = figures["alone"], figures["together"]
    ratios = [t / a for a, t in zip(alone, together, strict=True)]
    ratio = statistics.median(ratios)
    met = "" if goal is None else f" (goal >= {goal}: {'met' if ratio >= goal else 'missed'})"
    shared = figures["passes"]
    runs_a_pass = figures["jobs"] / shared if shared else 0.0
    return (
        f"service   : alone {statistics.median(alone):7.2f} steps/s, {runs} runs over gRPC "
        f"{statistics.median(together):7.2f} steps/s in all; ratio {ratio:.2f}{met} (each "
        f"round: {', '.join(f'{r:.2f}' for r in ratios)}); {shared} shared passes of "
        f"{runs_a_pass:.2f} runs on average held {figures['jobs']} of {figures['fb_calls']} "
        f"forward_backward calls; the first run done took {min(figures['shares']):.2f} of the "
        f"last one's time at worst; digests equal to alone: {sum(figures['equal'])}/"
        f"{len(figures['equal'])}"
    )
