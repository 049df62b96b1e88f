"""Concurrent sample requests, batched by the service, against one request and against generate.

    python bench/sampling_concurrent.py [--quick] [--threads N] [--shape tiny|small]
    python bench/sampling_concurrent.py --device cuda [--quick]   # bench/gpu.sh's figures

``8x4 vs 1x32``: the same prompt and max_tokens, temperature 1: one Sample request of 32
samples, against 8 requests of 4 samples (seeds 0..7) sent at once from 8 threads, and against
the same 8 sent one after another (each its own decode: what the service did before it batched
concurrent requests). Through the service (``SessionHost.apply``, in this process, as the gRPC
servicer calls it) and through the Tinker SDK (a server with the Tinker front in this process; a
LoRA client's sampler, the SDK's 8 futures all in flight). The ratio is time(8x4) / time(1x32);
goal <= 1.15.

``mixed``: 8 requests of prompt lengths 8, 16, 24 and 32 tokens, 4 samples each; half have
max_tokens N, half N/4 (they stop early). The service decodes them as one batch
(``TrainingSession.sample_many``, the logprob pass included, and without it: ``decode``);
transformers' ``generate`` runs the same rows batched by hand: one call per prompt length and
max_tokens (no padding), every row making its max_tokens. Ratio: the service's tokens/s over
generate's; goal >= 0.9. Medians over rounds; nothing is asserted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import tinker
import torch
from common import run_on_device  # bench/common.py
from engine import QWEN2_05B, synchronize, write_model  # bench/engine.py
from sampling import TimedLogprobs  # bench/sampling.py
from tinker import types

from trainwire.client import TrainingConfig
from trainwire.server.engine.sampling.sample_weights import LIVE_WEIGHTS
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.process import serve
from trainwire.server.service import operations as ops
from trainwire.server.service.host import SessionHost
from trainwire.server.service.requests import SampleRequest
from trainwire.server.service.sample_batching import params_of
from trainwire.testing import make_tiny_model

T = TypeVar("T")
KEY = "tml-trainwire-bench"
PROMPT_LENGTHS = (8, 16, 24, 32)


@dataclass(frozen=True)
class Setup:
    device: str
    precision: str
    shape: str
    max_tokens: int
    rounds: int


def timed(call: Callable[[], T], device: str) -> tuple[float, T]:
    """Seconds ``call`` took (the device synchronized), and what it returned."""
    synchronize(device)
    started = time.perf_counter()
    result = call()
    synchronize(device)
    return time.perf_counter() - started, result


def three_ways(send: Callable[[int, int], object], device: str, rounds: int) -> dict[str, float]:
    """Median seconds of 1x32, 8x4 at once and 8x4 one after another; ``send(samples, seed)``
    blocks until its samples are back."""
    times: dict[str, list[float]] = {"1x32": [], "8x4": [], "8x4 serial": []}
    with ThreadPoolExecutor(8) as pool:
        at_once = lambda: list(pool.map(lambda seed: send(4, seed), range(8)))  # noqa: E731
        cases = {
            "1x32": lambda: send(32, 0),
            "8x4": at_once,
            "8x4 serial": lambda: [send(4, seed) for seed in range(8)],
        }
        for round_ in range(rounds + 1):  # the first round warms up
            for name, call in cases.items():
                spent, _ = timed(call, device)
                if round_:
                    times[name].append(spent)
    return {name: statistics.median(values) for name, values in times.items()}


def print_ratios(label: str, figures: dict[str, float]) -> None:
    print(
        f"{label:28}{figures['1x32'] * 1e3:10.0f}{figures['8x4'] * 1e3:10.0f}"
        f"{figures['8x4 serial'] * 1e3:12.0f}{figures['8x4'] / figures['1x32']:9.3f}"
        f"{figures['8x4 serial'] / figures['1x32']:12.3f}"
    )


def service_case(host: SessionHost, prompt: list[int], setup: Setup) -> dict[str, float]:
    def send(samples: int, seed: int) -> object:
        request = SampleRequest(prompt, max_tokens=setup.max_tokens, num_samples=samples, seed=seed)
        return host.apply(ops.SAMPLE, request)

    return three_ways(send, setup.device, setup.rounds)


def sdk_case(work: Path, models: Path, prompt: list[int], setup: Setup) -> dict[str, float]:
    handle = serve(
        listen="127.0.0.1:0",
        state_dir=work / "sdk-state",
        model_root=models,
        device=setup.device,
        token=KEY,  # both ports keyed: never a keyed front beside an open gRPC port
        tinker_listen="127.0.0.1:0",
        tinker_token=KEY,
    )
    service = tinker.ServiceClient(base_url=handle.tinker.base_url, api_key=KEY)
    try:
        training = service.create_lora_training_client(base_model=setup.shape, rank=4).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        model_input = types.ModelInput.from_ints(prompt)

        def send(samples: int, seed: int) -> object:
            params = types.SamplingParams(max_tokens=setup.max_tokens, temperature=1.0, seed=seed)
            return sampler.sample(model_input, samples, params).result()

        return three_ways(send, setup.device, setup.rounds)
    finally:
        service.close("success").result(timeout=30)
        handle.stop(grace=10)


def mixed_requests(corpus: list[int], setup: Setup) -> list[SampleRequest]:
    long, short = setup.max_tokens, setup.max_tokens // 4
    return [
        SampleRequest(corpus[:length], max_tokens=tokens, num_samples=4, seed=seed)
        for seed, (length, tokens) in enumerate(
            (length, tokens) for length in PROMPT_LENGTHS for tokens in (long, short)
        )
    ]


def run_batched(session, requests: list[SampleRequest]) -> int:
    """Every request as one batch (the logprob pass included); the tokens made."""
    produced: list[int] = []

    def answered(samples, _prompt_logprobs) -> None:
        produced.append(sum(len(s.tokens) for s in samples))

    def failed(error: Exception) -> None:
        raise error

    calls = [
        BatchedSample(list(r.prompt_tokens), params_of(r), False, answered, failed)
        for r in requests
    ]
    session.sample_many(LIVE_WEIGHTS, calls)
    return sum(produced)


def run_generate_by_hand(session, requests: list[SampleRequest]) -> int:
    """One ``generate`` per (prompt length, max_tokens), all of its requests' rows at once."""
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for r in requests:
        rows = [list(r.prompt_tokens)] * r.num_samples
        groups.setdefault((len(r.prompt_tokens), r.max_tokens), []).extend(rows)
    produced = 0
    with torch.no_grad():
        for (_, max_tokens), rows in groups.items():
            input_ids = torch.tensor(rows, device=session.device)
            out = session.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                top_k=0,
                pad_token_id=session.tokenizer.pad_token_id,
            )
            produced += out[:, input_ids.shape[1] :].numel()
    return produced


def mixed_case(session, corpus: list[int], setup: Setup) -> dict[str, float]:
    requests = mixed_requests(corpus, setup)
    timer = TimedLogprobs(session)
    rates: dict[str, list[float]] = {"service": [], "decode": [], "generate": []}
    for round_ in range(setup.rounds + 1):
        timer.spent = 0.0
        ours, made = timed(partial(run_batched, session, requests), setup.device)
        theirs, their_made = timed(partial(run_generate_by_hand, session, requests), setup.device)
        if round_:
            rates["service"].append(made / ours)
            rates["decode"].append(made / (ours - timer.spent))
            rates["generate"].append(their_made / theirs)
    return {name: statistics.median(values) for name, values in rates.items()}


def print_table(setup: Setup, work: Path) -> None:
    models = work / "models"
    if setup.shape == "qwen2-0.5b":
        dtype = torch.bfloat16 if setup.precision == "bf16" else torch.float32
        model = write_model(models / setup.shape, QWEN2_05B, setup.device, dtype)
    else:
        model = make_tiny_model(models / setup.shape, size=setup.shape)
    config = TrainingConfig(
        model=str(model), lr_scheduler="constant", precision=setup.precision, max_length=256
    )
    host = SessionHost(work / "state", model_root=models, device=setup.device)
    host.recover()
    host.open("bench", config)
    session = host.session
    corpus = session.tokenize([Path(__file__).parents[1].joinpath("trainwire/data/corpus.txt")
                               .read_text()])[0]  # fmt: skip
    prompt = corpus[:32]
    print(f"{setup.shape}, {setup.device}, {setup.precision}, prompt 32 tokens, max_tokens "
          f"{setup.max_tokens}, temperature 1; medians of {setup.rounds} rounds")  # fmt: skip
    print(f"{'8x4 vs 1x32':28}{'1x32 ms':>10}{'8x4 ms':>10}{'serial ms':>12}{'ratio':>9}"
          f"{'serial/1x32':>12}")  # fmt: skip
    print_ratios("service (SessionHost.apply)", service_case(host, prompt, setup))
    mixed = mixed_case(session, corpus, setup)
    host.wait_idle()
    host.release()
    print_ratios("Tinker SDK (asample)", sdk_case(work, models, prompt, setup))
    print(f"{'mixed':28}{'service tok/s':>14}{'generate tok/s':>15}{'ratio':>7}{'decode':>8}")
    print(
        f"{'8 requests x 4, half early':28}{mixed['service']:14.0f}{mixed['generate']:15.0f}"
        f"{mixed['service'] / mixed['generate']:7.3f}{mixed['decode'] / mixed['generate']:8.3f}"
    )


def make_setup(device: str, shape: str | None, quick: bool) -> Setup:
    if device == "cuda":
        return Setup("cuda", "bf16", shape or "qwen2-0.5b", 128, 3 if quick else 5)
    return Setup("cpu", "fp32", shape or "small", 16 if quick else 64, 2 if quick else 5)


def main() -> None:
    run_on_device(__doc__.splitlines()[0], "fewer rounds, shorter samples", make_setup, print_table)


if __name__ == "__main__":
    main()
