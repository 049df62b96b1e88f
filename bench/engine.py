"""Engine overhead, measured side by side in one run.

    python bench/engine.py [--quick] [--threads N [--clock cpu]] [--model tiny|small]
                            # CPU, fp32: the tiny model (2 x 32), batches 4 x 64 and 8 x 128,
                            #            then llama 4 x 256, batch 8 x 128
    python bench/engine.py --device cuda [--quick]   # GPU: Qwen2-0.5B shape, bf16, sdpa,
                                                     #      batch 8 x 512 and 16 x 1024

(1) A training step, full weights and LoRA (r=16, all linear layers): the engine's
    ``forward_backward`` + ``optim_step`` against a plain hand-written transformers/PEFT loop
    (``model(**inputs).loss.backward()``, ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``,
    ``loss.item()``) on the same model (the plain loop trains a deep copy of the session's model,
    so both start from the same weights and adapters), the same AdamW parameter groups, the same
    clipping and the same input tensors: the engine gets text that tokenizes past the sequence
    length and cuts it (``truncation``); the plain loop gets the tensors the engine's encoder
    makes from that text, prepared before timing. So the engine's time includes everything it
    does per step (tokenizing and padding, its RNG and lock, the gradient norm read back), and
    the plain loop's is the bare step. Steps alternate one by one (ABBA order) after warmup;
    times are medians, the ratio is the median over adjacent pairs. Both sides train on the same
    batches in the same order, so their weights end equal to float tolerance, not bit for bit:
    the engine's causal-lm loss sums the same terms in chunks of positions (``chunked_logprobs``,
    which never holds ``[tokens x vocabulary]``), the plain loop's is transformers' over the
    whole logits. ``max |dw|`` is the largest weight difference at the end, held to
    ``SAME_WEIGHTS_ATOL`` in fp32 (in bf16 one rounding apart is a weight's last bit).
    Goal: engine / plain <= 1.05 on CPU (<= 1.03 on a GPU), <= 1.15 on the tiny model, whose
    step is short enough that the engine's fixed costs show (a tenth of a millisecond is about
    1 % of it). MFU counts 6N + 12·L·d·S FLOPs a token for full weights, 4N + 8·L·d·S (+ 6 per
    adapter parameter) for LoRA.

(2) Checkpoints: ``save_state`` / ``load_state`` against safetensors ``save_file`` /
    ``load_file`` of the same tensors (parameters, AdamW moments, pending gradients, RNG) in as
    many files (the files ``save_state`` writes, from ``TrainingSession.checkpoint_contents``).
    ``save_state`` also fsyncs and renames atomically, and records the state digest:
    computed during the save (its cache cleared first, as after an operation) or already cached.
    The raw save is shown without and with an fsync per file. The raw load is the least a restore
    does: ``load_file``, parameters copied into the live ones, owned copies of the rest
    (``load_file`` alone only maps the file). Ratio = raw time / engine time. Goal: >= 0.8.
    Measured on the last model of the run (the small llama on the CPU, unless ``--model tiny``).

Nothing is asserted; the script prints the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers.utils import logging as transformers_logging

from trainwire.client import InputExample, LoraSettings, TrainingConfig
from trainwire.server.engine.optimization import parameter_groups
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session import checkpoint as ckpt
from trainwire.testing import make_tiny_model
from trainwire.tiny_models import SHAPES

CORPUS = Path(__file__).resolve().parents[1] / "trainwire" / "data" / "corpus.txt"
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
# How far apart the engine's and the plain loop's fp32 weights may end: their losses differ in
# the last bits of a float sum, and AdamW moves a weight by about the learning rate (1e-4) a
# step, so a step that went wrong shows far above this.
SAME_WEIGHTS_ATOL = 1e-5

SMALL_LLAMA = {  # the CPU model: 4 layers x 256 hidden
    "arch": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
TINY = "tiny"  # make_tiny_model's llama (2 layers x 32 hidden), as it writes it
TINY_SHAPE = {**SHAPES[TINY], "arch": "llama"}
QWEN2_05B = {  # Qwen2-0.5B's shape, random weights
    "arch": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Model:
    name: str
    shape: dict[str, Any]  # written at random init by ``write_model``, except TINY's
    batches: tuple[tuple[int, int], ...]  # (batch size, sequence length)
    steps: int  # timed steps of each side


@dataclass(frozen=True)
class Setup:
    device: str
    precision: str
    models: tuple[Model, ...]
    warmup: int  # steps of each side before timing
    rounds: int  # timed checkpoint saves and loads
    # What a step's time is read from: the wall clock, or with ``--clock cpu`` this thread's CPU
    # time (a CPU step at one torch thread runs wholly on it, backward included), which other
    # processes' load on a shared machine changes far less than it changes the wall clock.
    clock: Callable[[], float] = time.perf_counter


def write_model(
    directory: Path, shape: dict[str, Any], device: str, dtype: torch.dtype, positions: int = 2048
) -> Path:
    """A model of ``shape`` with random weights and ``positions`` positions, with the tiny
    tokenizer (its ids fit any vocab)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    make_tiny_model(directory)  # the tokenizer; the tiny weights are replaced below
    tokenizer = AutoTokenizer.from_pretrained(directory)
    settings = {key: value for key, value in shape.items() if key != "arch"}
    settings.setdefault("vocab_size", len(tokenizer))
    config_class = LlamaConfig if shape["arch"] == "llama" else Qwen2Config
    config = config_class(
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="sdpa",
        **settings,
    )
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    config_path = directory / "config.json"
    data = json.loads(config_path.read_text())
    data["attn_implementation"] = "sdpa"
    config_path.write_text(json.dumps(data, indent=2))
    return directory


def long_texts(tokenizer: Any, count: int, length: int, seed: int) -> list[InputExample]:
    """Texts of corpus lines that tokenize just past ``length`` tokens (the engine cuts them)."""
    lines = [line for line in CORPUS.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        text = rng.choice(lines)
        while len(tokenizer(text)["input_ids"]) <= length:
            text += " " + rng.choice(lines)
        examples.append(InputExample(text))
    return examples


def session_config(model: Path, setup: Setup, batch: int, length: int, lora: bool):
    return TrainingConfig(
        model=str(model),
        lora=LoraSettings(r=16, alpha=32, dropout=0.0) if lora else None,
        learning_rate=1e-4,
        lr_scheduler="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        batch_size=batch,
        max_length=length,
        truncation=True,
        precision=setup.precision,
    )


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class PlainLoop:
    """The bare step a hand-written loop runs, on a copy of the session's model."""

    def __init__(self, session: TrainingSession) -> None:
        self.model = copy.deepcopy(session.model)
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        config = session.config
        self.max_grad_norm = config.max_grad_norm
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.model, config.weight_decay),
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
        )

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        loss = self.model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def timed(
    function: Callable[[], Any], device: str, clock: Callable[[], float] = time.perf_counter
) -> float:
    synchronize(device)
    started = clock()
    function()
    synchronize(device)
    return clock() - started


def build_model(model: Model, directory: Path, setup: Setup) -> Path:
    if model.name == TINY:
        return make_tiny_model(directory)
    dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
    return write_model(directory, model.shape, setup.device, dtype)


def compare_steps(
    model: Path, setup: Setup, batch: int, length: int, lora: bool, steps: int
) -> dict:
    """Median seconds per step for the engine and the plain loop, and their median ratio."""
    config = session_config(model, setup, batch, length, lora)
    session = TrainingSession(config, device=setup.device, max_steps=None)
    plain = PlainLoop(session)
    batches = [long_texts(session.tokenizer, batch, length, seed) for seed in range(4)]
    inputs = [session.encoder.encode(examples).inputs for examples in batches]
    assert all(t["input_ids"].shape == (batch, length) for t in inputs), "texts too short"

    def engine_step(examples: list[InputExample]) -> None:
        session.forward_backward(examples)
        session.optim_step()

    # Steps alternate one by one, in ABBA order, so a burst of load from elsewhere hits both
    # sides alike; the ratio is the median over adjacent pairs.
    times: dict[str, list[float]] = {"engine": [], "plain": [], "ratio": [], "encode": []}
    for j in range(setup.warmup + steps):
        i = j % len(batches)
        engine = partial(timed, partial(engine_step, batches[i]), setup.device, setup.clock)
        bare = partial(timed, partial(plain.step, inputs[i]), setup.device, setup.clock)
        if j % 2 == 0:
            spent = {"engine": engine(), "plain": bare()}
        else:
            spent = {"plain": bare(), "engine": engine()}
        if j >= setup.warmup:
            for side, value in spent.items():
                times[side].append(value)
            times["ratio"].append(spent["engine"] / spent["plain"])
    for examples in batches:
        encode = partial(session.encoder.encode, examples)
        times["encode"].append(timed(encode, setup.device, setup.clock))
    engine_params = dict(session.model.named_parameters())
    with torch.no_grad():
        apart = max(
            float((engine_params[n] - p).abs().max()) for n, p in plain.model.named_parameters()
        )
    result = {side: statistics.median(values) for side, values in times.items()}
    result["weights_apart"] = apart
    result["parameters"] = sum(p.numel() for p in session.model.parameters())
    result["trainable"] = sum(p.numel() for p in session.trainable_parameters())
    return result


def training_flops_per_token(result: dict, shape: dict[str, Any], length: int, lora: bool):
    """Model FLOPs per token: 6N + 12·L·d·S for full weights; LoRA skips the frozen weights'
    gradients, so 4N + 8·L·d·S (plus the adapters' own 6 per parameter)."""
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    n, attention = result["parameters"], layers * hidden * length
    if lora:
        return 4 * n + 8 * attention + 6 * result["trainable"]
    return 6 * n + 12 * attention


def peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def print_steps(directory: Path, model: Model, setup: Setup) -> None:
    peak = peak_flops(setup.device)
    for batch, length in model.batches:
        for lora in (False, True):
            result = compare_steps(directory, setup, batch, length, lora, model.steps)
            tokens = batch * length
            flops = training_flops_per_token(result, model.shape, length, lora) * tokens
            mfu = f"{flops / result['engine'] / peak:6.1%}" if peak else "   n/a"
            label = f"{model.name} {'lora r=16' if lora else 'full'} {batch}x{length}"
            print(
                f"{label:30} {result['engine'] * 1e3:10.1f} {result['plain'] * 1e3:10.1f} "
                f"{result['ratio']:7.3f} {tokens / result['engine']:10.0f} "
                f"{mfu} {result['encode'] * 1e3:10.2f}  {result['weights_apart']:.1e}"
                f"{' (too far)' if too_far(result, setup) else ''}"
            )
            if setup.device == "cuda":
                torch.cuda.empty_cache()


def too_far(result: dict, setup: Setup) -> bool:
    return setup.precision == "fp32" and result["weights_apart"] > SAME_WEIGHTS_ATOL


def state_tensors(session: TrainingSession) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors a checkpoint holds, grouped by the file they go to (the real writer's)."""
    return session.checkpoint_contents().tensor_files()


def raw_save(groups: dict[str, dict[str, torch.Tensor]], directory: Path, sync: bool) -> None:
    directory.mkdir()
    for name, tensors in groups.items():
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, directory / name)
        if sync:
            with open(directory / name, "rb") as handle:
                os.fsync(handle.fileno())


def raw_load(directory: Path, target: TrainingSession) -> None:
    """The least a restore does: parameters into the live ones, owned copies of the rest."""
    live = dict(target.model.named_parameters())
    for path in directory.iterdir():
        for key, tensor in load_file(path, device="cpu").items():
            if path.name == ckpt.MODEL_FILE:
                live[key].data.copy_(tensor)
            else:
                tensor.to(target.device, copy=True)


def engine_save(session: TrainingSession, directory: Path, cached: bool) -> None:
    if not cached:
        session.drop_digest_cache()  # as after an operation: the digest is computed on save
    session.save_state(directory)


def time_checkpoints(config: TrainingConfig, setup: Setup, work: Path) -> tuple[dict, int]:
    """Median seconds of each way to save and load the state; and its size in bytes."""
    session = TrainingSession(config, device=setup.device)
    examples = long_texts(session.tokenizer, config.batch_size, config.max_length, 0)
    session.forward_backward(examples)
    session.optim_step()
    session.forward_backward(examples)  # pending gradients, mid-accumulation
    groups = state_tensors(session)
    size = sum(t.numel() * t.element_size() for g in groups.values() for t in g.values())
    times: dict[str, list[float]] = {}
    for repetition in range(1 + setup.rounds):
        raw, durable, engine, cached = (
            work / f"{kind}-{repetition}" for kind in ("raw", "sync", "engine", "cached")
        )
        targets = [TrainingSession(config, device=setup.device) for _ in range(2)]
        measured = {
            "raw save": partial(raw_save, groups, raw, sync=False),
            "raw save + fsync": partial(raw_save, groups, durable, sync=True),
            "save_state": partial(engine_save, session, engine, cached=False),
            "save_state, digest cached": partial(engine_save, session, cached, cached=True),
            "raw load": partial(raw_load, raw, targets[0]),
            "load_state": partial(targets[1].load_state, engine),
        }
        for name, operation in measured.items():
            spent = timed(operation, setup.device)
            if repetition > 0:  # the first is warmup
                times.setdefault(name, []).append(spent)
        for directory in (raw, durable, engine, cached):
            shutil.rmtree(directory)
    return {name: statistics.median(values) for name, values in times.items()}, size


def print_checkpoints(model: Path, batches: tuple[tuple[int, int], ...], setup: Setup, work: Path):
    batch, length = batches[0]
    config = session_config(model, setup, batch, length, lora=False)
    median, size = time_checkpoints(config, setup, work)
    print(f"\n(2) checkpoints: {size / 2**20:.0f} MiB of parameters, AdamW moments, pending "
          f"gradients and RNG ({setup.device}); ratio = raw time / engine time")  # fmt: skip
    rows = [
        ("save_state", "raw save"),
        ("save_state, digest cached", "raw save"),
        ("save_state", "raw save + fsync"),
        ("save_state, digest cached", "raw save + fsync"),
        ("load_state", "raw load"),
    ]
    for engine, raw in rows:
        print(
            f"{engine:26} {median[engine] * 1e3:8.1f} ms {size / median[engine] / 1e9:5.2f} GB/s"
            f"   vs {raw:17} {median[raw] * 1e3:8.1f} ms {size / median[raw] / 1e9:5.2f} GB/s"
            f"   ratio {median[raw] / median[engine]:5.2f}"
        )


def make_setup(device: str, quick: bool, only: str | None, clock: str) -> Setup:
    if device == "cuda":
        qwen = Model(
            "qwen2-0.5b",
            QWEN2_05B,
            ((8, 512),) if quick else ((8, 512), (16, 1024)),
            steps=6 if quick else 20,
        )
        return Setup("cuda", "bf16", (qwen,), warmup=3, rounds=2 if quick else 5)
    cpu_time = {"cpu": time.thread_time, "wall": time.perf_counter}[clock]
    # The tiny model's steps take milliseconds: four times the steps for a steady median.
    tiny = Model(TINY, TINY_SHAPE, ((4, 64), (8, 128)), steps=24 if quick else 120)
    small = Model("small", SMALL_LLAMA, ((8, 128),), steps=6 if quick else 30)
    models = tuple(model for model in (tiny, small) if only in (None, model.name))
    return Setup("cpu", "fp32", models, warmup=2, rounds=3 if quick else 10, clock=cpu_time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer steps (and one GPU shape)")
    parser.add_argument(
        "--model", choices=(TINY, "small"), help="one CPU model (default: tiny, then small)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's, one per core)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="CPU steps timed by the wall clock or by this thread's CPU time (with --threads 1)",
    )
    args = parser.parse_args()
    if args.clock == "cpu" and (args.device == "cuda" or args.threads != 1):
        parser.error("--clock cpu needs --threads 1 on the CPU: other threads' work is not counted")
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers_logging.set_verbosity_error()  # the engine cuts long texts on purpose
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    setup = make_setup(args.device, args.quick, args.model, args.clock)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
        + (f", {torch.cuda.get_device_name()}" if setup.device == "cuda" else "")
    )
    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        work = Path(tmp)
        clock = "thread CPU time" if setup.clock is time.thread_time else "wall clock"
        print(f"\n(1) training step: engine vs plain loop ({setup.device}, {setup.precision}, "
              f"{clock})")  # fmt: skip
        print(f"{'':30} {'engine ms':>10} {'plain ms':>10} {'ratio':>7} {'tokens/s':>10} "
              f"{'MFU':>6} {'encode ms':>10}  max |dw|")  # fmt: skip
        for model in setup.models:
            directory = build_model(model, work / model.name, setup)
            print_steps(directory, model, setup)
            if model is not setup.models[-1]:
                shutil.rmtree(directory)
        last = setup.models[-1]
        print_checkpoints(directory, last.batches, setup, work)
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
