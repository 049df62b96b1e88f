"""Token-level training steps, measured side by side in one run.

    python bench/tokens.py [--quick] [--threads N]    # CPU: tiny and small llama, fp32
    python bench/tokens.py --device cuda [--quick]    # GPU: Qwen2-0.5B shape, bf16, sdpa
    python bench/tokens.py --shape qwen2-0.5b         # that shape on the CPU (slow)

One session per model (full weights, then LoRA r=16 on every linear layer) runs four kinds of
step, each ``forward_backward`` + ``optim_step``, on the same tokens:

- ``text``: text examples through the text path (tokenized with special tokens and EOS, labels =
  ids, the causal-lm mean cross-entropy, on the chunked logprobs path ``ce`` takes too);
- ``ce``: ``TokenExample(tokens=ids[:-1], target_tokens=ids[1:])`` from exactly the ids the text
  path encodes (read back from the session's own ``BatchEncoder``), ``cross_entropy``;
- ``is`` and ``ppo``: the same token examples with the sampling logprobs (the session's own
  ``forward`` before timing) and advantages of +-1, ``importance_sampling`` and ``ppo``.

Each round runs every kind once, in an order rotated round by round, so a burst of load from
elsewhere on a shared machine hits all of them alike. Times are medians over the timed rounds;
each ratio is the median over rounds of that round's ratio. Goals: ce / text <= 1.03;
is / ce and ppo / ce <= 1.05. Nothing is asserted; the script prints the figures.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import run_on_device  # bench/common.py
from engine import (  # bench/engine.py
    QWEN2_05B,
    long_texts,
    synchronize,
    write_model,
)

from trainwire.client import InputExample, LoraSettings, TrainingConfig
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import make_tiny_model

KINDS = ("text", "ce", "is", "ppo")
LOSS_OF = {"ce": "cross_entropy", "is": "importance_sampling", "ppo": "ppo"}
RATIOS = (("ce", "text", 1.03), ("is", "ce", 1.05), ("ppo", "ce", 1.05))


@dataclass(frozen=True)
class Setup:
    device: str
    precision: str
    shapes: tuple[str, ...]  # "tiny", "small" (make_tiny_model sizes) or "qwen2-0.5b"
    batch: int
    length: int  # tokens of every text example (its tokens are cut there)
    warmup: int  # rounds before timing
    rounds: int  # timed rounds (four times as many on the tiny model: its steps are short)


def build_model(shape: str, directory: Path, setup: Setup) -> Path:
    if shape == "qwen2-0.5b":
        dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
        return write_model(directory, QWEN2_05B, setup.device, dtype)  # bench/engine.py's
    return make_tiny_model(directory, size=shape)


def open_session(model: Path, setup: Setup, lora: bool) -> TrainingSession:
    config = TrainingConfig(
        model=str(model),
        lora=LoraSettings(r=16, alpha=32, dropout=0.0) if lora else None,
        learning_rate=1e-5,  # small: the ratio losses keep their ratios near 1
        lr_scheduler="constant",
        max_grad_norm=1.0,
        batch_size=setup.batch,
        max_length=setup.length,
        truncation=True,
        precision=setup.precision,
    )
    return TrainingSession(config, device=setup.device, max_steps=None)


def same_token_batches(
    session: TrainingSession, texts: list[InputExample], seed: int
) -> dict[str, list]:
    """The text batch and its token twins: the ids the text path itself encodes, shifted."""
    inputs = session.encoder.encode(texts).inputs
    rows = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(), strict=True)
    ]
    plain = [TokenExample(tuple(ids[:-1]), tuple(ids[1:])) for ids in rows]
    logprobs = session.forward(plain).logprobs  # on-policy: the sampler's q
    rng = random.Random(seed)
    scored = [
        TokenExample(
            e.tokens,
            e.target_tokens,
            logprobs=tuple(q),
            advantages=tuple(rng.choice((-1.0, 1.0)) for _ in q),
        )
        for e, q in zip(plain, logprobs, strict=True)
    ]
    return {"text": texts, "ce": plain, "is": scored, "ppo": scored}


def compare(model: Path, setup: Setup, lora: bool) -> dict[str, Any]:
    """Median seconds per step of each kind, and the median per-round ratios."""
    session = open_session(model, setup, lora)
    batches = [
        same_token_batches(session, long_texts(session.tokenizer, setup.batch, setup.length, s), s)
        for s in range(2)
    ]

    def step(kind: str, examples: list) -> Callable[[], None]:
        def run() -> None:
            if kind == "text":
                session.forward_backward(examples)
            else:
                session.forward_backward(examples, loss_fn=LOSS_OF[kind])
            session.optim_step()

        return run

    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    ratios: dict[tuple[str, str], list[float]] = {(a, b): [] for a, b, _ in RATIOS}
    rounds = setup.rounds * (4 if model.name == "tiny" else 1)
    for j in range(setup.warmup + rounds):
        batch = batches[j % len(batches)]
        order = KINDS[j % len(KINDS) :] + KINDS[: j % len(KINDS)]
        spent = {kind: timed(step(kind, batch[kind]), setup.device) for kind in order}
        if j >= setup.warmup:
            for kind, value in spent.items():
                times[kind].append(value)
            for a, b in ratios:
                ratios[(a, b)].append(spent[a] / spent[b])
    result = {kind: statistics.median(values) for kind, values in times.items()}
    result["ratios"] = {pair: statistics.median(values) for pair, values in ratios.items()}
    result["tokens"] = sum(len(e) for e in batches[0]["ce"])
    return result


def timed(function: Callable[[], Any], device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - started


def print_table(setup: Setup, work: Path) -> None:
    print(
        f"batch {setup.batch} x {setup.length} tokens, {setup.device}, {setup.precision}; "
        f"{setup.rounds} timed rounds (tiny: {4 * setup.rounds}) after {setup.warmup}"
    )
    header = "".join(f"{kind + ' ms':>10}" for kind in KINDS)
    goals = "".join(f"{a + '/' + b + f' (<={goal})':>17}" for a, b, goal in RATIOS)
    print(f"{'model':24}{header}{goals}{'ce tokens/s':>13}")
    for shape in setup.shapes:
        model = build_model(shape, work / shape, setup)
        for lora in (False, True):
            result = compare(model, setup, lora)
            times = "".join(f"{result[kind] * 1e3:10.1f}" for kind in KINDS)
            ratios = "".join(f"{result['ratios'][(a, b)]:17.3f}" for a, b, _ in RATIOS)
            label = f"{shape} {'lora r=16' if lora else 'full'}"
            print(f"{label:24}{times}{ratios}{result['tokens'] / result['ce']:13.0f}")
            if setup.device == "cuda":
                torch.cuda.empty_cache()


def make_setup(device: str, shape: str | None, quick: bool) -> Setup:
    if device == "cuda":
        return Setup(
            device="cuda",
            precision="bf16",
            shapes=(shape or "qwen2-0.5b",),
            batch=8,
            length=512,
            warmup=3,
            rounds=5 if quick else 20,
        )
    return Setup(
        device="cpu",
        precision="fp32",
        shapes=(shape,) if shape else ("tiny", "small"),
        batch=8,
        length=128,
        warmup=2,
        rounds=4 if quick else 24,
    )


def main() -> None:
    run_on_device(__doc__.splitlines()[0], "fewer rounds (a smoke run)", make_setup, print_table)


if __name__ == "__main__":
    main()
