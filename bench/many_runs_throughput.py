"""Many LoRA runs on one server: total steps per second against one run alone, and each run's share.

    python bench/many_runs_throughput.py [--quick] [--runs 8]    # CPU: the small llama (4 x 256)
    python bench/many_runs_throughput.py --device cuda --shape qwen2-0.5b [--quick]    # GPU: bf16

One ``serve(max_runs=N)`` on loopback (the server in this process, its clients on threads of
it, as in both configurations):

- ``alone``: one run, one client: ``forward_backward`` + ``optim_step`` steps back to back;
- ``interleaved``: N runs (seeds 0..N-1), a client each, all stepping at once.

Steps per second are counted over the same number of steps per run (``--steps``); the ratio is
interleaved total / alone (goal >= 0.9: the executor's turns cost nothing beside the work). Each
run's share is the steps it had finished when the first run finished all of its own, over the
steps all runs had finished then (goal: an eighth each, within +-10 %). ``--device`` and
``--shape`` are bench/many_runs.py's: on CUDA the runs train in bf16. Nothing is asserted.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from many_runs import (  # bench/many_runs.py
    SHAPES,
    OneLineParser,
    build_model,
    device_and_shape_arguments,
    on_gpu,
    precision_for,
    refuse_cuda_without_a_gpu,
)

GOAL_RATIO = 0.9
GOAL_SHARE_SPREAD = 0.10


def config(model: Path, seed: int, precision: str, r: int = 16):
    """A run of these benches: LoRA of rank ``r`` (alpha 2r) on every linear layer."""
    from trainwire.client import LoraSettings, TrainingConfig

    return TrainingConfig(
        model=str(model),
        lora=LoraSettings(r=r, alpha=2 * r, dropout=0.0, target_modules=("all-linear",)),
        seed=seed,
        learning_rate=1e-4,
        lr_scheduler="constant",
        batch_size=4,
        max_length=128,
        precision=precision,
    )


def step_loop(client, name: str, steps: int, done: list[int], first_done: threading.Event) -> None:
    from trainwire.testing import tiny_text_examples

    batch = tiny_text_examples(4, seed=1)
    for step in range(steps):
        client.forward_backward(batch, operation_key=f"{name}/{step}/fb")
        client.optim_step(operation_key=f"{name}/{step}/step")
        done[0] += 1
    first_done.set()


def run(
    server_port: int, model: Path, precision: str, runs: int, steps: int, label: str
) -> tuple[float, list[int]]:
    """Seconds for ``runs`` runs of ``steps`` steps at once, and each run's finished steps when
    the first run finished."""
    from trainwire.client import SessionClient

    clients = [SessionClient(f"127.0.0.1:{server_port}") for _ in range(runs)]
    for index, client in enumerate(clients):
        client.open(f"{label}-{index}", config(model, index, precision))
    counts = [[0] for _ in range(runs)]
    first_done = threading.Event()
    threads = [
        threading.Thread(target=step_loop, args=(c, f"{label}-{i}", steps, counts[i], first_done))
        for i, c in enumerate(clients)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    first_done.wait()
    at_first = [count[0] for count in counts]
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    for client in clients:
        client.close()
        client.close_channel()
    return elapsed, at_first


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    device_and_shape_arguments(parser)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (quick: 6)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    refuse_cuda_without_a_gpu(parser, args.device)
    steps = args.steps or (6 if args.quick else 20)
    precision = precision_for(args.device)
    from trainwire.server import serve

    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        model = build_model(args.shape, Path(tmp) / "models" / args.shape, args.device)
        handle = serve(
            listen="127.0.0.1:0",
            state_dir=Path(tmp) / "state",
            model_root=Path(tmp) / "models",
            device=args.device,
            max_runs=args.runs,
        )
        try:
            # The first steps pay for lazy imports (and on CUDA for its kernels' first launch).
            run(handle.port, model, precision, 1, 2, "warm-up")
            alone_s, _ = run(handle.port, model, precision, 1, steps, "alone")
            together_s, at_first = run(handle.port, model, precision, args.runs, steps, "together")
        finally:
            handle.stop()
    alone_rate = steps / alone_s
    together_rate = args.runs * steps / together_s
    ratio = together_rate / alone_rate
    shares = [count / sum(at_first) for count in at_first]
    spread = max(abs(share * args.runs - 1.0) for share in shares)
    print(
        f"{SHAPES[args.shape]}, {precision}{on_gpu(args.device)}, "
        f"LoRA r=16 on every linear layer; {steps} steps a run"
    )
    print(f"alone:       1 run,  {alone_rate:6.2f} steps/s")
    print(f"interleaved: {args.runs} runs, {together_rate:6.2f} steps/s in all")
    met = "met" if ratio >= GOAL_RATIO else "missed"
    print(f"ratio interleaved / alone: {ratio:.3f} (goal >= {GOAL_RATIO}: {met})")
    share_met = "met" if spread <= GOAL_SHARE_SPREAD else "missed"
    print(
        f"steps of each run when the first finished: {at_first}; largest departure from an "
        f"equal share {spread:.1%} (goal <= {GOAL_SHARE_SPREAD:.0%}: {share_met})"
    )


if __name__ == "__main__":
    main()
