"""LoRA runs' samples decoded together on one base against each run's samples in its own turn.

    python bench/samples_together.py [--quick] [--runs 8] [--shape tiny|small]     # CPU, fp32
    python bench/samples_together.py --device cuda --shape qwen2-0.5b [--quick]    # GPU, bf16

In this process, on one ``SharedBase`` (the engine, no server: what the scheduler would call),
N runs (seeds 0..N-1, LoRA r=8 on every linear layer, each trained one step on texts of its own
so the adapters differ) each ask for the same work a round: ``--requests`` requests of
``--samples`` samples, ``--max-tokens`` tokens at temperature 1, prompts of one length:

- ``turns``: each run's requests as one batch of its own, run after run (``sample_many``: how
  the scheduler decodes a run's samples today);
- ``together``: every run's requests as one batch (``together.sampling.sample_together``).

Turns and together alternate, round by round, so both see the same machine; the line gives the
medians over the rounds, in samples per second (every sample scored, as the service answers).
Every answer together is checked equal, pickled byte for byte, to the same request decoded in
its run's turn and alone.
"""

from __future__ import annotations

import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import many_runs  # bench/many_runs.py
from runs_together import config, synchronize, torch_threads  # bench/runs_together.py

PROMPT_TOKENS = 12


def requests_of(run: int, round_: int, args: Any, vocab: int) -> list[Any]:
    """Run ``run``'s sample requests of round ``round_``: prompts and seeds of its own."""
    import torch

    from trainwire.server.service.requests import SampleRequest

    generator = torch.Generator().manual_seed(10_000 * round_ + 100 * run)
    return [
        SampleRequest(
            torch.randint(3, vocab, (PROMPT_TOKENS,), generator=generator).tolist(),
            max_tokens=args.max_tokens,
            num_samples=args.samples,
            seed=1000 * round_ + 10 * run + index,
        )
        for index in range(args.requests)
    ]


class Answers:
    """Where each request's answer lands, pickled (every float's bits)."""

    def __init__(self) -> None:
        self.got: dict[tuple[int, int], bytes] = {}

    def call(self, request: Any, key: tuple[int, int]) -> Any:
        from trainwire.server.engine.sampling.sampler import BatchedSample
        from trainwire.server.service import reads, sample_batching

        def on_result(samples: list, scored: Any) -> None:
            self.got[key] = pickle.dumps((samples, scored))

        def on_error(error: Exception) -> None:
            raise error

        params = sample_batching.params_of(request)
        return BatchedSample(
            list(request.prompt_tokens), params, reads.prompt_scoring(request), on_result, on_error
        )


def in_turns(sessions: list, work: list[list[Any]]) -> dict[tuple[int, int], bytes]:
    from trainwire.server.engine.sampling.sample_weights import LIVE_WEIGHTS

    answers = Answers()
    for run, session in enumerate(sessions):
        calls = [answers.call(r, (run, i)) for i, r in enumerate(work[run])]
        session.sample_many(LIVE_WEIGHTS, calls)
    return answers.got


def together(sessions: list, work: list[list[Any]], invariance) -> dict[tuple[int, int], bytes]:
    from trainwire.server.engine.together.sampling import sample_together

    answers = Answers()
    pairs = [
        (session, answers.call(request, (run, index)))
        for run, session in enumerate(sessions)
        for index, request in enumerate(work[run])
    ]
    sample_together(pairs, list, invariance)
    return answers.got


def alone(sessions: list, work: list[list[Any]]) -> dict[tuple[int, int], bytes]:
    """Each request decoded by itself in its run (untimed)."""
    got = {}
    for run, session in enumerate(sessions):
        for index, request in enumerate(work[run]):
            got.update({(run, index): in_turns([session], [[request]])[(0, 0)]})
    return got


def trained_runs(model: Path, precision: str, device: str, runs: int) -> list[Any]:
    from trainwire.server.engine.session import TrainingSession
    from trainwire.server.engine.weights.shared_base import SharedBase
    from trainwire.testing import tiny_text_examples

    base = SharedBase(config(model, 0, precision), device=device)
    sessions = []
    for seed in range(runs):
        session = TrainingSession(config(model, seed, precision), device=device, base=base)
        session.forward_backward(tiny_text_examples(4, seed=seed))
        session.optim_step()
        sessions.append(session)
    return sessions


def measure(sessions: list, args: Any, invariance, device: str) -> tuple[list, list, int, int]:
    """Samples per second in turns and together, each round; answers equal to turns' and to
    alone's, and how many there were."""
    vocab = sessions[0].sampler.vocab_size
    turns_rates, together_rates, equal, total = [], [], 0, 0
    samples = len(sessions) * args.requests * args.samples
    for round_ in range(args.rounds + 1):  # round 0 warms up (first kernels), untimed
        work = [requests_of(run, round_, args, vocab) for run in range(len(sessions))]
        synchronize(device)
        started = time.perf_counter()
        want = in_turns(sessions, work)
        synchronize(device)
        turns_s = time.perf_counter() - started
        started = time.perf_counter()
        got = together(sessions, work, invariance)
        synchronize(device)
        together_s = time.perf_counter() - started
        if round_:
            turns_rates.append(samples / turns_s)
            together_rates.append(samples / together_s)
        first_alone = alone(sessions, work) if round_ == 1 else want
        equal += sum(got[key] == want[key] == first_alone[key] for key in want)
        total += len(want)
    return turns_rates, together_rates, equal, total


def main() -> None:
    parser = many_runs.OneLineParser(description=__doc__.splitlines()[0])
    many_runs.device_and_shape_arguments(parser)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests a run a round")
    parser.add_argument("--samples", type=int, default=4, help="samples a request")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=None, help="turns/together (quick: 2)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    many_runs.refuse_cuda_without_a_gpu(parser, args.device)
    args.rounds = args.rounds or (2 if args.quick else 4)
    precision = many_runs.precision_for(args.device)
    from trainwire.server.engine.together import row_invariance

    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        model = many_runs.build_model(args.shape, Path(tmp) / args.shape, args.device)
        sessions = trained_runs(model, precision, args.device, args.runs)
        invariance = row_invariance(sessions[0].model)
        shape, device = many_runs.SHAPES[args.shape], many_runs.on_gpu(args.device)
        print(
            f"{shape}, {precision}{device}, LoRA r=8 on every linear "
            f"layer; {args.runs} runs x {args.requests} requests x {args.samples} samples of "
            f"{args.max_tokens} tokens after {PROMPT_TOKENS}, {args.rounds} rounds, "
            f"{torch_threads()} threads"
        )
        turns, together_, equal, total = measure(sessions, args, invariance, args.device)
        ratio = statistics.median(t / a for a, t in zip(turns, together_, strict=True))
        print(
            f"turns {statistics.median(turns):8.2f} samples/s, together "
            f"{statistics.median(together_):8.2f} samples/s; ratio {ratio:.2f} (each round: "
            f"{', '.join(f'{t / a:.2f}' for a, t in zip(turns, together_, strict=True))}); "
            f"answers equal to turns and alone: {equal}/{total}"
        )
        print(f"row invariance on this device: {invariance}")


if __name__ == "__main__":
    main()
