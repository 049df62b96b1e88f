"""Sampling throughput: ``TrainingSession.sample`` against transformers' ``generate``, one run.

    python bench/sampling.py [--quick] [--threads N]    # CPU: tiny and small llama, fp32
    python bench/sampling.py --device cuda [--quick]    # GPU: Qwen2-0.5B shape, bf16, sdpa
    python bench/sampling.py --shape qwen2-0.5b         # that shape on the CPU (slow)

Both sides run the session's own model object (eval mode, no gradients) on the same prompt with
the same ``max_tokens``, greedy and at temperature 1 with top_p 0.9, for 1 and for 8 samples:

- ``session``: ``TrainingSession.sample`` (a KV-cache decode, then the exact logprob pass: one
  full forward per sample). Its ``Sampler.logprobs`` is wrapped to time that pass on its own.
- ``generate``: ``model.generate(max_new_tokens=N, min_new_tokens=N)`` on the prompt repeated
  once per sample, as the session batches them (greedy refuses ``num_return_sequences``); top_k
  off, as the session's ``top_k=0``. It always makes N tokens a sample.

The session cannot be told to ignore EOS, so a sample may end early; each side's tokens/s counts
the tokens it actually produced (a batch of 8 decodes on until its last sample ends, so an early
stop costs the session throughput). Each round runs both sides, alternating which goes first;
times are medians, the ratio is the median over rounds of session tokens/s / generate tokens/s
("decode": the same ratio with the logprob pass's time taken out of the session's).
Goal: >= 0.9 with the logprob pass included. Nothing is asserted; the script prints the figures.
Concurrent requests, batched by the service: bench/sampling_concurrent.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import run_on_device  # bench/common.py
from engine import QWEN2_05B, synchronize, write_model  # bench/engine.py

from trainwire.client import TrainingConfig
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import make_tiny_model

CORPUS = Path(__file__).resolve().parents[1] / "trainwire" / "data" / "corpus.txt"
MODES = (("greedy", 0.0, 1.0), ("t=1 top_p=0.9", 1.0, 0.9))  # (name, temperature, top_p)


@dataclass(frozen=True)
class Setup:
    device: str
    precision: str
    shapes: tuple[str, ...]  # "tiny", "small" (make_tiny_model sizes) or "qwen2-0.5b"
    prompt_tokens: int
    max_tokens: int
    samples: tuple[int, ...]
    warmup: int  # rounds before timing
    rounds: int  # timed rounds


def build_model(shape: str, directory: Path, setup: Setup) -> Path:
    if shape == "qwen2-0.5b":
        dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
        return write_model(directory, QWEN2_05B, setup.device, dtype)  # bench/engine.py's
    return make_tiny_model(directory, size=shape)


def prompt_of(session: TrainingSession, length: int) -> list[int]:
    """The first ``length`` tokens (special tokens included) of the corpus."""
    ids = session.tokenize([CORPUS.read_text()])[0]
    return ids[:length]


class TimedLogprobs:
    """Wraps a sampler's ``logprobs`` (the exact recomputation pass) and sums its time."""

    def __init__(self, session: TrainingSession) -> None:
        self.inner = session.sampler.logprobs
        self.device = session.device.type
        self.spent = 0.0
        session.sampler.logprobs = self  # an instance attribute shadows the method

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[float, ...]:
        synchronize(self.device)
        started = time.perf_counter()
        values = self.inner(*args, **kwargs)
        synchronize(self.device)
        self.spent += time.perf_counter() - started
        return values


def run_session(session, prompt, setup, samples, temperature, top_p, seed, logprob_timer):
    logprob_timer.spent = 0.0
    synchronize(setup.device)
    started = time.perf_counter()
    drawn = session.sample(
        prompt,
        max_tokens=setup.max_tokens,
        num_samples=samples,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )
    synchronize(setup.device)
    spent = time.perf_counter() - started
    return spent, sum(len(s.tokens) for s in drawn), logprob_timer.spent, drawn


def run_generate(session, prompt, setup, samples, temperature, top_p, seed):
    model = session.model
    input_ids = torch.tensor([prompt] * samples, device=session.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    options = sampling if temperature > 0 else {"do_sample": False}
    torch.manual_seed(seed)
    synchronize(setup.device)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=setup.max_tokens,
            min_new_tokens=setup.max_tokens,
            pad_token_id=session.tokenizer.pad_token_id,
            **options,
        )
    synchronize(setup.device)
    spent = time.perf_counter() - started
    new = out[:, len(prompt) :]
    return spent, new.numel(), new.tolist()


def compare(session, prompt, setup, samples, temperature, top_p, timer) -> dict[str, Any]:
    times: dict[str, list[float]] = {"session": [], "generate": [], "logprobs": []}
    rates: dict[str, list[float]] = {"session": [], "generate": [], "ratio": [], "decode": []}
    produced = []
    same_greedy = True
    for j in range(setup.warmup + setup.rounds):
        seed = j
        if j % 2 == 0:
            ours = run_session(session, prompt, setup, samples, temperature, top_p, seed, timer)
            theirs = run_generate(session, prompt, setup, samples, temperature, top_p, seed)
        else:
            theirs = run_generate(session, prompt, setup, samples, temperature, top_p, seed)
            ours = run_session(session, prompt, setup, samples, temperature, top_p, seed, timer)
        if temperature == 0:  # greedy: the same tokens up to the session's stop
            same_greedy &= all(
                list(s.tokens) == g[: len(s.tokens)]
                for s, g in zip(ours[3], theirs[2], strict=True)
            )
        if j < setup.warmup:
            continue
        times["session"].append(ours[0])
        times["logprobs"].append(ours[2])
        times["generate"].append(theirs[0])
        rates["session"].append(ours[1] / ours[0])
        rates["generate"].append(theirs[1] / theirs[0])
        rates["ratio"].append(rates["session"][-1] / rates["generate"][-1])
        rates["decode"].append(ours[1] / (ours[0] - ours[2]) / rates["generate"][-1])
        produced.append(ours[1])
    result = {key: statistics.median(values) for key, values in times.items()}
    result.update({f"{key} rate": statistics.median(values) for key, values in rates.items()})
    result["logprob share"] = statistics.median(
        lp / total for lp, total in zip(times["logprobs"], times["session"], strict=True)
    )
    result["produced"] = statistics.median(produced)
    result["same greedy"] = same_greedy if temperature == 0 else None
    return result


def print_table(setup: Setup, work: Path) -> None:
    print(f"prompt {setup.prompt_tokens} tokens, max_tokens {setup.max_tokens}, {setup.device}, "
          f"{setup.precision}; {setup.rounds} timed rounds after {setup.warmup}")  # fmt: skip
    print(f"{'model, mode, samples':32}{'session ms':>11}{'generate ms':>12}{'tokens':>8}"
          f"{'session tok/s':>14}{'generate tok/s':>15}{'ratio':>7}{'logprob %':>10}{'decode':>8}"
          f"  greedy same")  # fmt: skip
    for shape in setup.shapes:
        model = build_model(shape, work / shape, setup)
        session = TrainingSession(
            # max_length: the tiny models' positions (a session refuses more than a model holds).
            TrainingConfig(
                model=str(model),
                lr_scheduler="constant",
                precision=setup.precision,
                max_length=256,
            ),
            device=setup.device,
        )
        session.model.eval()  # generate's side; sample sets eval mode itself
        timer = TimedLogprobs(session)
        prompt = prompt_of(session, setup.prompt_tokens)
        for mode, temperature, top_p in MODES:
            for samples in setup.samples:
                r = compare(session, prompt, setup, samples, temperature, top_p, timer)
                same = {None: "", True: "yes", False: "NO"}[r["same greedy"]]
                label = f"{shape}, {mode}, {samples}"
                print(
                    f"{label:32}{r['session'] * 1e3:11.1f}{r['generate'] * 1e3:12.1f}"
                    f"{r['produced']:>5.0f}/{samples * setup.max_tokens:<3}"
                    f"{r['session rate']:14.0f}{r['generate rate']:15.0f}{r['ratio rate']:7.3f}"
                    f"{r['logprob share']:10.1%}{r['decode rate']:8.3f}  {same}"
                )
        del session, timer
        if setup.device == "cuda":
            torch.cuda.empty_cache()


def make_setup(device: str, shape: str | None, quick: bool) -> Setup:
    if device == "cuda":
        return Setup(
            device="cuda",
            precision="bf16",
            shapes=(shape or "qwen2-0.5b",),
            prompt_tokens=128,
            max_tokens=256,
            samples=(1, 8),
            warmup=1,
            rounds=3 if quick else 7,
        )
    return Setup(
        device="cpu",
        precision="fp32",
        shapes=(shape,) if shape else ("tiny", "small"),
        prompt_tokens=32,
        max_tokens=32 if quick else 128,
        samples=(1, 8),
        warmup=1,
        rounds=3 if quick else 9,
    )


def main() -> None:
    run_on_device(__doc__.splitlines()[0], "fewer rounds, shorter samples", make_setup, print_table)


if __name__ == "__main__":
    main()
