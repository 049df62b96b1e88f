"""Plan and write the manifest of a large run: wall time and peak memory.

    python bench/plan.py [--examples 1000000]

Goal on a 2-core machine: 1,000,000 examples (batch 32, accumulation 4, 3 epochs, length
grouping) planned and written in under 10 s and under 2 GiB.
"""

from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from pathlib import Path

from trainwire.client import InputExample, ManagedTrainingPlan, TrainingConfig, write_plan_manifest

WORDS = "the a good bad movie film food service great awful happy sad was is very not".split()  # noqa: SIM905


def synthetic_examples(count: int) -> list[InputExample]:
    rng = random.Random(0)
    return [
        InputExample(" ".join(rng.choices(WORDS, k=rng.randint(4, 40))), completion="ok")
        for _ in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1_000_000)
    args = parser.parse_args()
    examples = synthetic_examples(args.examples)
    config = TrainingConfig(
        model="llama", batch_size=32, gradient_accumulation_steps=4, num_epochs=3,
        group_by_length=True,
    )  # fmt: skip
    baseline_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "manifest.json"
        started = time.perf_counter()
        plan = ManagedTrainingPlan(examples, config)
        planned = time.perf_counter()
        write_plan_manifest(output, plan)
        written = time.perf_counter()
        size_mib = output.stat().st_size / 2**20
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"examples           {args.examples:,}")
    print(f"microbatches       {plan.batch_count:,}  updates {plan.max_steps:,}")
    print(f"plan               {planned - started:6.2f} s")
    print(f"manifest + write   {written - planned:6.2f} s  ({size_mib:.0f} MiB)")
    print(f"total              {written - started:6.2f} s  (goal < 10 s)")
    print(f"peak RSS           {peak_mib:6.0f} MiB  (goal < 2048)")
    print(f"  of which examples{baseline_rss_mib:6.0f} MiB")


if __name__ == "__main__":
    main()
