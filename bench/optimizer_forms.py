"""AdamW's per-tensor loop against its multi-tensor (``foreach``) form, on a LoRA run's update.

    python bench/optimizer_forms.py [--shape tiny|small] [--busy 3] [--rounds 6]

One ``TrainingSession`` (LoRA r=8 on every linear layer, 4 texts a step) takes ``optim_step``s
with its optimizer in one form, then the other, round by round, so both see the same machine;
only the ``optim_step`` is timed. Twice: on a quiet interpreter, and beside ``--busy`` Python
threads that keep the interpreter lock busy, as a server's transport threads do while the
engine thread updates: each kernel call gives the lock up and must take it back, and the
per-tensor loop makes about seven calls per tensor where the multi-tensor form makes one per
step for all of them. Both forms give the same bits on the CPU (``tests/test_optimizer_forms.py``).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

from many_runs import SHAPES, OneLineParser, build_model  # bench/many_runs.py
from runs_together import config, one_stream  # bench/runs_together.py

STEPS_A_ROUND = 20


def busy_threads(count: int) -> tuple[list[threading.Thread], threading.Event]:
    """``count`` threads running Python, pausing briefly as a handler waiting on I/O does."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(2000))
            time.sleep(0.0002)

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads, stop


def milliseconds_a_step(session, foreach: bool) -> float:
    for group in session.optimizer.param_groups:
        group["foreach"] = foreach
    spent = 0.0
    for step in range(STEPS_A_ROUND):
        session.forward_backward(one_stream(0, step))
        started = time.perf_counter()
        session.optim_step()
        spent += time.perf_counter() - started
    return 1000 * spent / STEPS_A_ROUND


def measure(session, busy: int, rounds: int) -> tuple[float, float]:
    """Median milliseconds an ``optim_step`` takes, per-tensor and multi-tensor."""
    threads, stop = busy_threads(busy)
    loop, multi = [], []
    try:
        for _ in range(rounds):
            loop.append(milliseconds_a_step(session, foreach=False))
            multi.append(milliseconds_a_step(session, foreach=True))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return statistics.median(loop), statistics.median(multi)


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--busy", type=int, default=3, help="busy Python threads beside it")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from trainwire.server.engine.session import TrainingSession

    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        model = build_model(args.shape, Path(tmp) / args.shape, "cpu")
        session = TrainingSession(config(model, 0, "fp32"), device="cpu")
        milliseconds_a_step(session, foreach=True)  # warm: first kernels, the moments
        parameters = sum(1 for p in session.model.parameters() if p.requires_grad)
        print(f"{SHAPES[args.shape]}, LoRA r=8 on every linear layer: {parameters} tensors")
        for label, busy in (("quiet", 0), (f"{args.busy} busy threads", args.busy)):
            loop, multi = measure(session, busy, args.rounds)
            print(
                f"{label:16}: optim_step per-tensor {loop:6.2f} ms, multi-tensor {multi:6.2f} ms;"
                f" ratio {loop / multi:.2f}"
            )


if __name__ == "__main__":
    main()
