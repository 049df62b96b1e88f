"""Where a remote step's CPU goes: the server's threads, the engine's own work, the client.

    python bench/service_threads.py [--steps 200] [--in-flight 4] [--rounds 2]

The tiny llama (4 texts a step), torch on one thread on both sides. The server runs in a process
of its own (``serve()``, as ``trainwire serve`` does), the client here; an in-process
``TrainingSession`` steps the same batches for reference. For each side, alternating round by
round: wall time per step (ForwardBackward + OptimStep), and the CPU time each of the server's
threads spent per step, read from ``/proc`` by thread name; the engine's own work
(``TrainingSession.forward_backward`` and ``optim_step``, timed by the engine thread's CPU clock
inside the server) is split out of the engine thread's total. Three remote sides: blocking calls
one after another, and pipelined (``*_async``) with ``--in-flight`` calls on the wire.

What it tells apart: time the service adds on the engine thread (the engine thread's CPU less
the engine's work), work on other threads that competes with the engine for the two cores and
the GIL, and the engine itself running slower beside them (its work timed remote against
in-process). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ENGINE_METHODS = ("forward_backward", "optim_step")


def serve_and_report(state: Path, models: Path, port_file: Path, report: Path) -> None:
    """The server side: ``serve()`` until killed; on SIGUSR2, the CPU seconds of each thread
    (by name) and of the engine's own methods so far, written to ``report``."""
    import torch

    torch.set_num_threads(1)
    from trainwire.server import serve
    from trainwire.server.engine.session.session import TrainingSession

    engine_cpu: Counter[str] = Counter()

    def timed(name: str):
        method = getattr(TrainingSession, name)

        def run(self, *args, **kwargs):
            start = time.thread_time()
            try:
                return method(self, *args, **kwargs)
            finally:
                engine_cpu[name] += time.thread_time() - start

        return run

    for name in ENGINE_METHODS:  # this process's own instrumentation, for the figure only
        setattr(TrainingSession, name, timed(name))
    handle = serve(listen="127.0.0.1:0", state_dir=state, model_root=models, device="cpu")

    def write_report(*_: object) -> None:
        threads = {thread.native_id: thread.name for thread in threading.enumerate()}
        by_name: Counter[str] = Counter()
        ticks = os.sysconf("SC_CLK_TCK")
        for task in os.listdir("/proc/self/task"):
            fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
            name = (
                threads.get(int(task))
                or "native: " + Path(f"/proc/self/task/{task}/comm").read_text().strip()
            )
            by_name[name.rstrip("0123456789_")] += seconds
        tmp = report.with_suffix(".tmp")
        tmp.write_text(json.dumps({"threads": by_name, "engine": engine_cpu}))
        os.replace(tmp, report)

    signal.signal(signal.SIGUSR2, write_report)
    port_file.write_text(str(handle.port))
    while True:
        time.sleep(1)


class ServerProcess:
    def __init__(self, work: Path, models: Path) -> None:
        self.report = work / "report.json"
        port_file = work / "port"
        command = [sys.executable, __file__, "--serve", str(work / "state"), str(models)]
        command += [str(port_file), str(self.report)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(command, env=env)
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def cpu(self) -> dict[str, Counter[str]]:
        """Each thread's CPU seconds so far, and the engine methods'."""
        self.report.unlink(missing_ok=True)
        os.kill(self.process.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not self.report.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the server wrote no report")
            time.sleep(0.01)
        data = json.loads(self.report.read_text())
        return {"threads": Counter(data["threads"]), "engine": Counter(data["engine"])}

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_and_report(*(Path(p) for p in args.serve))
        return
    import torch

    torch.set_num_threads(1)
    from trainwire.client import SessionClient, TrainingConfig
    from trainwire.server import TrainingSession
    from trainwire.testing import make_tiny_model, tiny_text_examples

    work = Path(tempfile.mkdtemp())
    models = work / "models"
    make_tiny_model(models / "tiny")
    config = TrainingConfig(model="tiny", batch_size=4, max_length=64, learning_rate=1e-3)
    examples = tiny_text_examples(64)
    batches = [examples[i * 4 : i * 4 + 4] for i in range(16)]
    server = ServerProcess(work, models)
    client = SessionClient(f"127.0.0.1:{server.port}", max_in_flight=args.in_flight)
    local = TrainingSession(config, device="cpu", max_steps=10**6, model_root=models)
    position = 0
    try:
        client.wait_until_serving()
        client.open("bench", config, max_steps=10**6)

        def in_process(key: int) -> None:
            local.forward_backward(batches[key % len(batches)])
            local.optim_step()

        def blocking(key: int) -> None:
            nonlocal position
            batch = batches[key % len(batches)]
            client.forward_backward(batch, operation_key=f"fb/{key}", expected_position=position)
            client.optim_step(operation_key=f"opt/{key}", expected_position=position + 1)
            position += 2

        def pipelined(key: int) -> object:
            nonlocal position
            batch = batches[key % len(batches)]
            client.forward_backward_async(
                batch, operation_key=f"fb/{key}", expected_position=position
            )
            step = client.optim_step_async(
                operation_key=f"opt/{key}", expected_position=position + 1
            )
            position += 2
            return step

        sides = {"in-process": in_process, "blocking": blocking, "pipelined": pipelined}
        figures: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        key = 0
        for name, step in sides.items():  # warm up every side
            for _ in range(10):
                last = step(key)
                key += 1
            if name == "pipelined":
                last.result()
        for _ in range(args.rounds):
            for name, step in sides.items():
                before, client_before = server.cpu(), time.process_time()
                local_before = time.thread_time()
                start = time.perf_counter()
                for _ in range(args.steps):
                    last = step(key)
                    key += 1
                if name == "pipelined":
                    last.result()
                wall = time.perf_counter() - start
                after = server.cpu()
                per_step = 1e3 / args.steps
                row = {"wall": wall * per_step}
                if name == "in-process":
                    row["engine"] = (time.thread_time() - local_before) * per_step
                else:
                    threads = after["threads"] - before["threads"]
                    engine = sum((after["engine"] - before["engine"]).values())
                    row.update({f"thread {t}": s * per_step for t, s in threads.items()})
                    row["engine"] = engine * per_step
                    row["client process"] = (time.process_time() - client_before) * per_step
                figures[name].append(row)
    finally:
        client.close_channel()
        server.stop()
    print(
        f"tiny llama, 4 texts a step, {args.steps} steps a round, {args.rounds} rounds "
        f"(medians), torch 1 thread, pipelined {args.in_flight} calls in flight; ms per step:"
    )
    local_wall = statistics.median(r["wall"] for r in figures["in-process"])
    local_engine = statistics.median(r["engine"] for r in figures["in-process"])
    print(f"  in-process: wall {local_wall:.2f}, engine CPU {local_engine:.2f}")
    for name in ("blocking", "pipelined"):
        rows = figures[name]
        wall = statistics.median(r["wall"] for r in rows)
        engine = statistics.median(r["engine"] for r in rows)
        thread_names = sorted({k for r in rows for k in r if k.startswith("thread ")})
        cpu = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in thread_names}
        engine_thread = cpu.pop("thread trainwire-engine", 0.0)
        print(
            f"  {name}: wall {wall:.2f} ({wall / local_wall:.2f}x in-process); engine thread "
            f"{engine_thread:.2f} = engine work {engine:.2f} ({engine / local_engine:.2f}x "
            f"in-process) + service {engine_thread - engine:.2f}"
        )
        others = ", ".join(f"{k[7:]} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda i: -i[1]))
        print(f"    other server threads: {others}")
        client_cpu = statistics.median(r["client process"] for r in rows)
        print(f"    client process (its whole CPU, the in-process session idle): {client_cpu:.2f}")


if __name__ == "__main__":
    main()
