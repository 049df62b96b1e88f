"""Many LoRA runs on one base model: resident memory, shared base against a base each, in one run.

    python bench/many_runs.py [--quick] [--runs 8]    # CPU: the small llama (4 x 256), fp32

Three configurations, each in a fresh process of its own, one after the other:

- ``alone-1``: one LoRA session (r=16, every linear layer) loading the base model itself, as a
  server with one run does;
- ``shared-N``: N such sessions (seeds 0..N-1) on one ``SharedBase``, the base in memory once;
- ``alone-N``: N such sessions each loading its own base, for contrast.

Each process imports torch, transformers and peft, reads its resident memory (VmRSS), opens its
sessions and trains one update on each (a ``forward_backward`` and an ``optim_step``, so AdamW's
moments exist), and reads VmRSS again. glibc's mmap threshold is fixed at 64 KiB in every process,
so a freed tensor leaves the resident set at once and the figures hold what is live, not what the
allocator kept. Shown: RSS, RSS added by the sessions (over the imports), and the bytes of the
tensors they hold (parameters and buffers by storage, so a shared base counts once, plus
optimizer moments). Ratio = shared-N RSS / alone-1 RSS. Goal: <= 1.25. The added memory is
shown too: on a model this small an r=16 adapter and its moments are a tenth of the base, where
on a billion-parameter model they are a fraction of a percent, so there N adapters cost little
beside the one base.

Nothing is asserted; the script prints the figures (``--json``: one JSON object instead).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GOAL = 1.25
MMAP_THRESHOLD_BYTES = 64 * 1024  # as bench/long_context.py: freed tensors leave the RSS
MIB = 1024 * 1024


def rss_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024


def tensor_bytes(sessions: list[Any]) -> int:
    """Parameters and buffers counted once per storage (a shared base once), plus moments."""
    import torch

    storages: dict[int, int] = {}
    moments = 0
    for session in sessions:
        for tensor in [*session.model.parameters(), *session.model.buffers()]:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        for state in session.optimizer.state.values():
            moments += sum(
                value.untyped_storage().nbytes()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            )
    return sum(storages.values()) + moments


def measure(kind: str, runs: int, model: str, quick: bool) -> dict[str, Any]:
    """In this fresh process: RSS before and after ``runs`` sessions of ``kind`` trained once."""
    import peft  # noqa: F401  imported before the baseline, as torch and transformers are
    import transformers  # noqa: F401
    from transformers.utils import logging as transformers_logging

    from trainwire.client import LoraSettings, TrainingConfig
    from trainwire.server.engine.session import TrainingSession
    from trainwire.server.engine.weights.shared_base import SharedBase
    from trainwire.testing import tiny_text_examples

    transformers_logging.set_verbosity_error()
    examples = tiny_text_examples(2 if quick else 8, seed=0)

    def config(seed: int) -> TrainingConfig:
        return TrainingConfig(
            model=model,
            lora=LoraSettings(r=16, alpha=32, dropout=0.0),
            seed=seed,
            learning_rate=1e-4,
            lr_scheduler="constant",
            batch_size=len(examples),
            max_length=128,
        )

    gc.collect()
    before = rss_bytes()
    base = SharedBase(config(0), device="cpu") if kind == "shared" else None
    sessions = [TrainingSession(config(seed), device="cpu", base=base) for seed in range(runs)]
    for session in sessions:
        session.forward_backward(examples)
        session.optim_step()
    gc.collect()
    after = rss_bytes()
    return {"rss": after, "added": after - before, "tensors": tensor_bytes(sessions)}


def measure_in_child(kind: str, runs: int, model: Path, quick: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", kind, "--runs", str(runs), "--model", str(model)]
    if quick:
        command.append("--quick")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{kind} x {runs} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(figures: dict[str, dict[str, Any]], runs: int) -> None:
    header = ("configuration", "sessions", "RSS MiB", "added MiB", "tensors MiB")
    print("{:<14} {:>8} {:>9} {:>10} {:>12}".format(*header))
    for name, row in figures.items():
        count = 1 if name == "alone-1" else runs
        mib = [row[key] / MIB for key in ("rss", "added", "tensors")]
        print("{:<14} {:>8} {:>9.1f} {:>10.1f} {:>12.1f}".format(name, count, *mib))
    one = figures["alone-1"]
    for name in (f"shared-{runs}", f"alone-{runs}"):
        row = figures[name]
        ratio = row["rss"] / one["rss"]
        goal = f" (goal <= {GOAL}: {'met' if ratio <= GOAL else 'missed'})"
        added, tensors = row["added"] / one["added"], row["tensors"] / one["tensors"]
        print(
            f"{name} / alone-1: RSS {ratio:.3f}{goal if name.startswith('shared') else ''}, "
            f"added {added:.2f}, tensors {tensors:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8, help="sessions on one base (default 8)")
    parser.add_argument("--quick", action="store_true", help="a batch of 2 texts, not 8")
    parser.add_argument("--json", action="store_true", help="one JSON object, not a table")
    parser.add_argument("--one", choices=("alone", "shared"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.runs, args.model, args.quick)))
        return
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 (the figures compare with one), got {args.runs}")
    from trainwire.testing import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        model = make_tiny_model(Path(tmp) / "small-llama", size="small")
        plan = {"alone-1": ("alone", 1), f"shared-{args.runs}": ("shared", args.runs)}
        plan[f"alone-{args.runs}"] = ("alone", args.runs)
        figures = {
            name: measure_in_child(kind, runs, model, args.quick)
            for name, (kind, runs) in plan.items()
        }
    if args.json:
        print(json.dumps({"runs": args.runs, "figures": figures}))
        return
    print(f"small llama (4 x 256), fp32, LoRA r=16 on every linear layer, {args.runs} runs")
    print_table(figures, args.runs)


if __name__ == "__main__":
    main()
