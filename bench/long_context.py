"""Long sequences: what a ``forward_backward`` adds to memory, chunked head against whole.

    python bench/long_context.py                       # CPU: tiny llama, 151,936 vocab, fp32
    python bench/long_context.py --lengths 2048 8192 --plain-lengths 2048
    python bench/long_context.py --kind text --lengths 2048 --plain-lengths 2048
    python bench/long_context.py --device cuda         # GPU: Qwen2.5-0.5B shape, bf16, sdpa

One sequence, full weights and LoRA (r=16, every linear layer but the head): ``--kind tokens``
(the default) is a ``TokenExample`` of random ids under ``cross_entropy``; ``--kind text`` is a
causal-lm ``InputExample`` of corpus text cut to the length (``truncation``), under the text
path's native loss. Two paths on the same sequence: ``chunked`` is the engine's
(``chunked_logprobs``: the head, log-softmax and the gathered targets over chunks of positions,
recomputed in the backward); ``whole`` is the path the engine had before, installed through a
``LossHook`` (the engine's public customization point): for tokens the model's whole logits,
gathered minus ``logsumexp``; for text the model's own loss (``model(**inputs).loss``).

Each (length, setup, path) runs in two fresh processes, one for memory and one for time: the
session loads and one warmup ``forward_backward`` allocates the gradients. Peak added = the
highest resident memory during the next ``forward_backward`` minus the resident memory before it
(CPU: Linux's VmHWM reset through /proc/self/clear_refs, with glibc's mmap threshold fixed at
64 KiB so a freed tensor leaves the resident set at once; CUDA: the allocator's peak over
``memory_allocated``), compared with the fp32 logits of the sequence, T x V x 4 bytes. Step time
is the median of ``--steps`` timed ``forward_backward`` calls in the other process, under
glibc's default allocation (the fixed threshold costs a page fault per fresh page, on both paths
alike). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine import QWEN2_05B, long_texts, write_model  # bench/engine.py

from trainwire.client import LoraSettings, TrainingConfig
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.loss.loss_hook import LossHook
from trainwire.server.engine.session import TrainingSession

QWEN_VOCAB = 151936
SHAPES = {
    # The CPU model: 64 wide, 2 layers, Qwen's vocabulary, tied head (~40 MB of weights).
    "tiny-qwen-vocab": {
        "arch": "llama",
        "vocab_size": QWEN_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": QWEN2_05B,  # bench/engine.py's: Qwen2.5-0.5B's shape, random weights
}
SETUPS = ("full", "lora")
PATHS = ("chunked", "whole")
KINDS = ("tokens", "text")
MMAP_THRESHOLD_BYTES = 65536


class WholeLogitsHook(LossHook):
    """The engine's paths before chunking: the model's logits for every position at once."""

    def compute_loss(self, model, batch, *, training):
        return model(**batch.inputs)

    def compute_token_loss(self, model, batch, loss, config, *, training):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits.float()
        picked = logits.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        logp = (picked - torch.logsumexp(logits, dim=-1))[batch.mask]
        return loss.fn(logp, batch.inputs, config), logp


class PeakMemory:
    """Resident memory (CPU) or allocated memory (CUDA) added at its peak since ``reset``."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0

    def reset(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
            self.base = _status_kib("VmRSS") * 1024

    def added(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1))


def measure_one(args: argparse.Namespace) -> dict[str, Any]:
    """One (length, setup, path) in this process: peak added and step times."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    config = TrainingConfig(
        model=args.model,
        task="causal-lm",
        max_length=args.length,
        precision="bf16" if args.device == "cuda" else "fp32",
        lora=LoraSettings(r=16, alpha=32) if args.setup == "lora" else None,
        gradient_checkpointing=args.gradient_checkpointing,
        truncation=args.kind == "text",
    )
    hook = WholeLogitsHook if args.path == "whole" else LossHook
    session = TrainingSession(config, device=args.device, loss_hook=hook)
    if args.kind == "text":
        example = long_texts(session.tokenizer, 1, args.length, seed=0)
        assert session.encoder.encode(example).token_count == args.length
    else:
        generator = torch.Generator().manual_seed(args.length)
        ids = torch.randint(0, QWEN_VOCAB, (args.length + 1,), generator=generator).tolist()
        example = [TokenExample(ids[:-1], ids[1:])]
    session.forward_backward(example)  # warmup: gradients allocated, kernels chosen
    assert dtype == session.dtype
    if args.measure == "memory":
        peak = PeakMemory(args.device)
        peak.reset()
        session.forward_backward(example)
        return {"peak_added": peak.added()}
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        session.forward_backward(example)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times)}


def run_child(args: argparse.Namespace, model: Path, length: int, setup: str, path: str):
    """Memory, then time, each in a fresh process."""
    return {
        **_child(args, model, length, setup, path, "memory"),
        **_child(args, model, length, setup, path, "time"),
    }


def _child(args, model: Path, length: int, setup: str, path: str, measure: str):
    command = [
        sys.executable,
        __file__,
        "--one",
        "--model",
        str(model),
        "--device",
        args.device,
        "--length",
        str(length),
        "--setup",
        setup,
        "--path",
        path,
        "--steps",
        str(args.steps),
        "--measure",
        measure,
        "--kind",
        args.kind,
    ]
    if args.gradient_checkpointing:
        command.append("--gradient-checkpointing")
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = dict(os.environ)
    if measure == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--lengths", type=int, nargs="+", help="default: cpu 2048 8192")
    parser.add_argument("--plain-lengths", type=int, nargs="*", help="whole logits at these")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--kind", choices=KINDS, default="tokens", help="the example's kind")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=("memory", "time"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    if args.one:
        print(json.dumps(measure_one(args)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; run without --device")
    cuda = args.device == "cuda"
    lengths = args.lengths or ([8192, 32768] if cuda else [2048, 8192])
    plain = args.plain_lengths if args.plain_lengths is not None else ([8192] if cuda else [2048])
    shape_name = "qwen2.5-0.5b" if cuda else "tiny-qwen-vocab"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {shape_name}, "
        f"{'bf16' if cuda else 'fp32'}, {args.kind}, "
        f"gradient checkpointing {args.gradient_checkpointing}"
        + (f", {torch.cuda.get_device_name()}" if cuda else "")
    )
    print("| tokens | setup | path | peak added (GB) | x fp32 logits | step (s) | vs whole |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="trainwire-long-") as tmp:
        model = Path(tmp) / "model"
        dtype = torch.bfloat16 if cuda else torch.float32
        write_model(model, SHAPES[shape_name], "cpu", dtype, max(lengths + plain) + 1)
        for length in sorted(set(lengths) | set(plain)):
            logits_bytes = length * QWEN_VOCAB * 4
            for setup in args.setups:
                results = {}
                for path in PATHS:
                    if path == "whole" and length not in plain:
                        continue
                    if path == "chunked" and length not in lengths:
                        continue
                    results[path] = run_child(args, model, length, setup, path)
                for path, result in results.items():
                    if "error" in result:  # the message (out of memory, say) in the table
                        print(f"| {length} | {setup} | {path} | {result['error']} | | | |")
                        continue
                    ratio = ""
                    whole = results.get("whole", {})
                    if path == "chunked" and "step_s" in whole:
                        ratio = f"{result['step_s'] / whole['step_s']:.2f}"
                    print(
                        f"| {length} | {setup} | {path} | {result['peak_added'] / 1e9:.3f} | "
                        f"{result['peak_added'] / logits_bytes:.3f} | {result['step_s']:.2f} | "
                        f"{ratio} |"
                    )


if __name__ == "__main__":
    main()
