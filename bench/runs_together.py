"""LoRA runs computed together on one base against one run alone: total steps per second.

    python bench/runs_together.py [--quick] [--runs 8] [--shape tiny|small]     # CPU, fp32
    python bench/runs_together.py --device cuda --shape qwen2-0.5b [--quick]    # GPU, bf16
    python bench/runs_together.py --service [--quick] [--runs 8] [--shape tiny|small]

In this process, on one ``SharedBase`` (the engine, no server: what the scheduler would call):

- ``alone``: one run, ``forward_backward`` + ``optim_step`` steps back to back;
- ``together``: N runs (seeds 0..N-1); each step, the runs' ``forward_backward`` requests whose
  padded widths agree run as one pass (``engine.together.run_together``; a request of a width
  of its own runs alone), then each run's own ``optim_step``.

Alone and together take turns, round by round, so both see the same machine; each line gives
the medians over the rounds. Two kinds of data, each its own line: ``one stream`` (every run
trains on the same 4 texts a step, as a sweep over seeds and adapters does) and ``own texts``
(each run draws its own 4 texts a step, so widths differ and a step takes a pass per width).
Every run's state digest after the together steps is checked equal to the same run's digest
alone (each run stepped again on its own). Goals (issue 45): together / alone >= 2.0 on the
tiny llama, >= 1.3 on the small one.

``--service`` measures the same through a server instead (``runs_together_service``): N runs
driven by N concurrent gRPC clients, each in a process of its own (``--client-threads``: on
threads of the server's process, as measured before 2026-12-07), the scheduler taking their ready
calls as shared passes, against one run alone on that server.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from many_runs import (  # bench/many_runs.py
    SHAPES,
    OneLineParser,
    build_model,
    device_and_shape_arguments,
    on_gpu,
    precision_for,
    refuse_cuda_without_a_gpu,
)
from many_runs_throughput import config as run_config  # bench/many_runs_throughput.py
from runs_together_service import measure_service, report  # bench/runs_together_service.py

GOALS = {"tiny": 2.0, "small": 1.3}
TEXTS_A_STEP = 4
Texts = Callable[[int, int], list]  # (run, step) -> that step's texts


def config(model: Path, seed: int, precision: str):
    return run_config(model, seed, precision, r=8)


def one_stream(run: int, step: int) -> list:
    from trainwire.testing import tiny_text_examples

    return tiny_text_examples(TEXTS_A_STEP, seed=step)


def own_texts(run: int, step: int) -> list:
    from trainwire.testing import tiny_text_examples

    return tiny_text_examples(TEXTS_A_STEP, seed=1000 * run + step)


def step_alone(session, examples: list) -> None:
    session.forward_backward(examples)
    session.optim_step()


def steps_together(sessions: list, texts: Texts, step: int, invariance) -> int:
    """One step of every run: a pass per group of compatible requests; returns the passes."""
    from trainwire.server.engine.together import Request, group_together, run_together

    requests = [Request(session, texts(run, step)) for run, session in enumerate(sessions)]
    groups = group_together(requests, invariance)
    for group in groups:
        if len(group) > 1:
            run_together([requests[index] for index in group], invariance)
        else:
            request = requests[group[0]]
            request.session.forward_backward(request.examples)
    for session in sessions:
        session.optim_step()
    return len(groups)


def measure(model: Path, precision: str, device: str, runs: int, steps: int, rounds: int, texts):
    """Steps per second alone (run 0) and together (all runs) in each round (alone, then
    together, so both see the same machine), the passes a step took, and whether every run's
    digest together equals its digest alone after all rounds."""
    from trainwire.server.engine.session import TrainingSession
    from trainwire.server.engine.together import row_invariance
    from trainwire.server.engine.weights.shared_base import SharedBase

    base = SharedBase(config(model, 0, precision), device=device)

    def session(seed: int) -> Any:
        return TrainingSession(config(model, seed, precision), device=device, base=base)

    warm = [session(seed) for seed in range(runs)]  # lazy imports, first kernels, the probe
    invariance = row_invariance(warm[0].model)
    steps_together(warm, texts, 0, invariance)
    step_alone(warm[0], texts(0, 0))
    del warm

    alone = [session(seed) for seed in range(runs)]
    together = [session(seed) for seed in range(runs)]
    alone_rates, together_rates, passes = [], [], 0
    for round_ in range(rounds):
        first = round_ * steps
        synchronize(device)
        started = time.perf_counter()
        for step in range(first, first + steps):
            step_alone(alone[0], texts(0, step))
        synchronize(device)
        alone_rates.append(steps / (time.perf_counter() - started))
        started = time.perf_counter()
        for step in range(first, first + steps):
            passes += steps_together(together, texts, step, invariance)
        synchronize(device)
        together_rates.append(runs * steps / (time.perf_counter() - started))
    for run in range(1, runs):  # untimed: every other run alone too, for its digest
        for step in range(rounds * steps):
            step_alone(alone[run], texts(run, step))
    equal = [a.state_digest() == t.state_digest() for a, t in zip(alone, together, strict=True)]
    return alone_rates, together_rates, passes / (rounds * steps), equal, invariance


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    device_and_shape_arguments(parser)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="steps a round (quick: 4)")
    parser.add_argument("--rounds", type=int, default=None, help="alone/together (quick: 2)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--service", action="store_true", help="through a server and gRPC clients (see above)"
    )
    parser.add_argument(
        "--client-threads",
        action="store_true",
        help="--service: each run's client on a thread of the server's process, not a process",
    )
    args = parser.parse_args()
    refuse_cuda_without_a_gpu(parser, args.device)
    steps = args.steps or (4 if args.quick else 8)
    rounds = args.rounds or (2 if args.quick else 3)
    precision = precision_for(args.device)
    goal = GOALS.get(args.shape)
    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        model = build_model(args.shape, Path(tmp) / args.shape, args.device)
        print(
            f"{SHAPES[args.shape]}, {precision}{on_gpu(args.device)}, LoRA r=8 on every linear "
            f"layer, {TEXTS_A_STEP} texts a step; {rounds} rounds of {steps} steps a run, "
            f"{args.runs} runs together, {torch_threads()} threads"
        )
        if args.service:
            figures = measure_service(
                Path(tmp),
                model,
                lambda seed: config(model, seed, precision),
                args.device,
                args.runs,
                steps,
                rounds,
                client_threads=args.client_threads,
            )
            print(report(figures, args.runs, goal))
            return
        for label, texts in (("one stream", one_stream), ("own texts", own_texts)):
            alone, together, passes, equal, invariance = measure(
                model, precision, args.device, args.runs, steps, rounds, texts
            )
            ratio = statistics.median(t / a for a, t in zip(alone, together, strict=True))
            met = (
                "" if goal is None else f" (goal >= {goal}: {'met' if ratio >= goal else 'missed'})"
            )
            print(
                f"{label:10}: alone {statistics.median(alone):7.2f} steps/s, together "
                f"{statistics.median(together):7.2f} steps/s in all, {passes:.2f} passes a "
                f"step; ratio {ratio:.2f}{met} (each round: "
                f"{', '.join(f'{t / a:.2f}' for a, t in zip(alone, together, strict=True))}); "
                f"digests equal to alone: {sum(equal)}/{len(equal)}"
            )
        print(f"row invariance on this device: {invariance}")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
