"""Many LoRA runs on one base model: resident memory, shared base against a base each, in one run.

    python bench/many_runs.py [--quick] [--runs 8]    # CPU: the small llama (4 x 256), fp32
    python bench/many_runs.py --device cuda --shape qwen2-0.5b [--quick]    # GPU: bf16, sdpa

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

On CUDA the figure is GPU memory instead of VmRSS: each process reads
``torch.cuda.memory_allocated`` (what stays live) and ``max_memory_allocated`` (the peak, one
step's activations on top) once its sessions have stepped; the ratio and its goal are on the
allocated memory. ``--shape qwen2-0.5b`` is Qwen2-0.5B's shape at random init (bench/engine.py's
``write_model``), in bf16 on CUDA and fp32 on the CPU (slow there).

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
from typing import Any, NoReturn

GOAL = 1.25
MMAP_THRESHOLD_BYTES = 64 * 1024  # as bench/long_context.py: freed tensors leave the RSS
MIB = 1024 * 1024
SHAPES = {  # --shape: what each builds, for the header line
    "small": "small llama (4 x 256)",
    "tiny": "tiny llama (2 x 32)",
    "qwen2-0.5b": "Qwen2-0.5B shape (24 x 896, random weights)",
}
# The figures each device reads, the first one the goal's: (key in measure's result, label).
FIGURES = {
    "cpu": (("rss", "RSS"), ("added", "added"), ("tensors", "tensors")),
    "cuda": (("allocated", "GPU allocated"), ("peak", "GPU peak"), ("tensors", "tensors")),
}


class OneLineParser(argparse.ArgumentParser):
    """Refuses in one line, no usage block: from bench/gpu.sh's log the reason is all one reads."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def device_and_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--shape``, shared with bench/many_runs_throughput.py."""
    parser.add_argument("--device", choices=tuple(FIGURES), default="cpu")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="small", help="default: small")


def refuse_cuda_without_a_gpu(parser: argparse.ArgumentParser, device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: CUDA is not available here (torch {torch.__version__}); "
            "use --device cpu for the CPU figures"
        )


def on_gpu(device: str) -> str:
    """For a header line: which GPU, on CUDA (the CPU's lines name no device)."""
    import torch

    return f" on {torch.cuda.get_device_name()}" if device == "cuda" else ""


def precision_for(device: str) -> str:
    return "bf16" if device == "cuda" else "fp32"


def build_model(shape: str, directory: Path, device: str) -> Path:
    """The model of ``shape`` in ``directory``: a tiny llama of trainwire.testing, or the
    Qwen2-0.5B shape at random init in the precision the sessions train in."""
    from trainwire.testing import make_tiny_model

    if shape != "qwen2-0.5b":
        return make_tiny_model(directory, size=shape)
    import torch
    from engine import QWEN2_05B, write_model  # bench/engine.py
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # its bar would fill bench/gpu.sh's log
    dtype = torch.bfloat16 if precision_for(device) == "bf16" else torch.float32
    return write_model(directory, QWEN2_05B, device, dtype)


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


def measure(kind: str, runs: int, model: str, quick: bool, device: str) -> dict[str, Any]:
    """In this fresh process: RSS before and after ``runs`` sessions of ``kind`` trained once
    (on CUDA: the GPU memory allocated after, and its peak)."""
    import peft  # noqa: F401  imported before the baseline, as torch and transformers are
    import torch
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
            lora=LoraSettings(r=16, alpha=32, dropout=0.0, target_modules=("all-linear",)),
            seed=seed,
            learning_rate=1e-4,
            lr_scheduler="constant",
            batch_size=len(examples),
            max_length=128,
            precision=precision_for(device),
        )

    gc.collect()
    before = rss_bytes()
    base = SharedBase(config(0), device=device) if kind == "shared" else None
    sessions = [TrainingSession(config(seed), device=device, base=base) for seed in range(runs)]
    for session in sessions:
        session.forward_backward(examples)
        session.optim_step()
    gc.collect()
    tensors = tensor_bytes(sessions)
    if device == "cuda":
        torch.cuda.synchronize()
        return {
            "allocated": torch.cuda.memory_allocated(),
            "peak": torch.cuda.max_memory_allocated(),
            "tensors": tensors,
        }
    after = rss_bytes()
    return {"rss": after, "added": after - before, "tensors": tensors}


def measure_in_child(kind: str, runs: int, model: Path, quick: bool, device: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--one", kind, "--runs", str(runs), "--model", str(model)]
    command += ["--device", device]
    if quick:
        command.append("--quick")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{kind} x {runs} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def width(label: str) -> int:
    """A column's width: its "<label> MiB" heading and a space before it, 9 at least."""
    return max(9, len(label) + 5)


def print_table(figures: dict[str, dict[str, Any]], runs: int, device: str) -> None:
    columns = FIGURES[device]
    header = [f" {label + ' MiB':>{width(label)}}" for _, label in columns]
    print(f"{'configuration':<14} {'sessions':>8}" + "".join(header))
    for name, row in figures.items():
        count = 1 if name == "alone-1" else runs
        cells = [f" {row[key] / MIB:>{width(label)}.1f}" for key, label in columns]
        print(f"{name:<14} {count:>8}" + "".join(cells))
    one = figures["alone-1"]
    (goal_key, goal_label), *others = columns
    for name in (f"shared-{runs}", f"alone-{runs}"):
        row = figures[name]
        ratio = row[goal_key] / one[goal_key]
        goal = f" (goal <= {GOAL}: {'met' if ratio <= GOAL else 'missed'})"
        rest = ", ".join(f"{label} {row[key] / one[key]:.2f}" for key, label in others)
        print(
            f"{name} / alone-1: {goal_label} {ratio:.3f}"
            f"{goal if name.startswith('shared') else ''}, {rest}"
        )


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    device_and_shape_arguments(parser)
    parser.add_argument("--runs", type=int, default=8, help="sessions on one base (default 8)")
    parser.add_argument("--quick", action="store_true", help="a batch of 2 texts, not 8")
    parser.add_argument("--json", action="store_true", help="one JSON object, not a table")
    parser.add_argument("--one", choices=("alone", "shared"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.runs, args.model, args.quick, args.device)))
        return
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 (the figures compare with one), got {args.runs}")
    refuse_cuda_without_a_gpu(parser, args.device)

    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        model = build_model(args.shape, Path(tmp) / args.shape, args.device)
        plan = {"alone-1": ("alone", 1), f"shared-{args.runs}": ("shared", args.runs)}
        plan[f"alone-{args.runs}"] = ("alone", args.runs)
        figures = {
            name: measure_in_child(kind, runs, model, args.quick, args.device)
            for name, (kind, runs) in plan.items()
        }
    if args.json:
        print(
            json.dumps(
                {"runs": args.runs, "device": args.device, "shape": args.shape, "figures": figures}
            )
        )
        return
    print(
        f"{SHAPES[args.shape]}, {precision_for(args.device)}{on_gpu(args.device)}, "
        f"LoRA r=16 on every linear layer, {args.runs} runs"
    )
    print_table(figures, args.runs, args.device)


if __name__ == "__main__":
    main()
