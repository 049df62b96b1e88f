"""The Tinker SDK's training step against trainwire's own client, on the same data.

    python bench/tinker_sdk.py [--quick] [--threads N] [--in-process]

Two ``trainwire serve`` processes, each on its own state directory, as in real use (a client
never shares its process, and so its GIL, with the server): one serves the SDK (its HTTP front),
one is driven by ``SessionClient`` over gRPC, with the config the front builds for the SDK's
``create_lora_training_client(rank=4)``; both clients run in this process. ``--in-process``
starts the servers inside this process instead (the SDK, the servers and our client then share
one GIL, which costs the SDK's Python-heavy event loop most). A step is forward_backward
(cross-entropy on the same token data) + optim_step, futures included, both issued before either
is awaited, as the SDK's docs write it; the own-client side pipelines the same way
(``*_async``). The sides alternate round by round; each side's figure is its best round's
median. Goals: ≤ 1.10 on the tiny model, ≤ 1.02 on the small llama.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import tinker
import torch
from tinker import types

from trainwire.client import SessionClient, TokenExample
from trainwire.server.process import ServerHandle, serve
from trainwire.server.tinker.model import fit_lora_roles, fit_max_length, training_config
from trainwire.testing import free_port, make_tiny_model, tiny_text_examples

KEY = "tml-trainwire-bench"
RATE = 1e-3
# Every wait is bounded: a step that stalls fails the bench with both servers' stacks and logs
# (a step takes well under a second; on a loaded 2-core machine, seconds).
WAIT_S = 180


@contextlib.contextmanager
def server(state: Path, models: Path, *, tinker_front: bool) -> Iterator[ServerHandle]:
    # Both ports keyed, as a front always is beside a keyed gRPC port.
    front = {"tinker_listen": "127.0.0.1:0", "tinker_token": KEY, "token": KEY}
    options = front if tinker_front else {}
    handle = serve(
        listen="127.0.0.1:0", state_dir=state, model_root=models, device="cpu", **options
    )
    try:
        yield handle
    finally:
        handle.stop(grace=10)


@contextlib.contextmanager
def server_process(state: Path, models: Path, *, tinker_front: bool) -> Iterator[tuple[int, str]]:
    """``trainwire serve`` in its own process; its gRPC port and the Tinker front's base URL."""
    state.mkdir(parents=True)
    port_file = state.parent / f"{state.name}.port"
    command = [
        sys.executable, "-m", "trainwire", "serve", "--listen", "127.0.0.1:0",
        "--state-dir", str(state), "--model-root", str(models), "--device", "cpu",
        "--port-file", str(port_file),
    ]  # fmt: skip
    base_url = ""
    if tinker_front:
        key_file = state.parent / f"{state.name}.key"
        key_file.write_text(KEY + "\n")
        tinker_port = free_port()
        command += ["--tinker-listen", f"127.0.0.1:{tinker_port}", "--tinker-token-file"]
        command += [str(key_file), "--token-file", str(key_file)]
        base_url = f"http://127.0.0.1:{tinker_port}"
    env = dict(os.environ)
    if torch.get_num_threads() != (os.cpu_count() or 1):  # --threads: the server's torch too
        env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    log = state.parent / f"{state.name}.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trainwire serve did not start: {command}")
            time.sleep(0.05)
        yield int(port_file.read_text()), base_url
    except BaseException:
        # The server's side of a failure or a stall: its stacks where it waits, then its log.
        if process.poll() is None:
            os.kill(process.pid, signal.SIGUSR1)
            time.sleep(1)
        print(f"--- {log.name} (exit {process.poll()}), last lines:", file=sys.stderr)
        print("\n".join(log.read_text().splitlines()[-150:]), file=sys.stderr)
        raise
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


@contextlib.contextmanager
def servers(work: Path, models: Path, model: str, in_process: bool) -> Iterator[tuple[str, int]]:
    """The SDK's base URL and our client's gRPC port, on two fresh servers."""
    if in_process:
        with (
            server(work / f"{model}-sdk", models, tinker_front=True) as sdk_server,
            server(work / f"{model}-own", models, tinker_front=False) as own_server,
        ):
            yield sdk_server.tinker.base_url, own_server.port
        return
    with (
        server_process(work / f"{model}-sdk", models, tinker_front=True) as (_, base_url),
        server_process(work / f"{model}-own", models, tinker_front=False) as (port, _),
    ):
        yield base_url, port


def token_rows(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(e.text) for e in tiny_text_examples(count, seed=11)]


def sdk_step(client) -> Callable[[list[list[int]]], None]:
    def step(rows: list[list[int]]) -> None:
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
            for ids in rows
        ]
        fwd_bwd = client.forward_backward(data, "cross_entropy")
        optim = client.optim_step(types.AdamParams(learning_rate=RATE))
        fwd_bwd.result(timeout=WAIT_S)
        optim.result(timeout=WAIT_S)

    return step


def own_step(client: SessionClient, prefix: str) -> Callable[[list[list[int]]], None]:
    count = 0

    def step(rows: list[list[int]]) -> None:
        nonlocal count
        batch = [TokenExample(ids[:-1], ids[1:]) for ids in rows]
        fwd_bwd = client.forward_backward_async(batch, operation_key=f"{prefix}/{count}/fb")
        optim = client.optim_step_async(operation_key=f"{prefix}/{count}/step", learning_rate=RATE)
        fwd_bwd.result(timeout=WAIT_S)
        optim.result(timeout=WAIT_S)
        count += 1

    return step


def timed(
    step: Callable[[list[list[int]]], None], batches, rounds_steps: int
) -> tuple[float, float]:
    """The median step's wall time, and this process's CPU time per step (every thread: with
    the servers in their own processes, what the client itself costs)."""
    times = []
    cpu_started = time.process_time()
    for i in range(rounds_steps):
        started = time.perf_counter()
        step(batches[i % len(batches)])
        times.append(time.perf_counter() - started)
    return statistics.median(times), (time.process_time() - cpu_started) / rounds_steps


def compare(
    model: str, models: Path, work: Path, rounds: int, steps: int, in_process: bool
) -> tuple[tuple[float, float], tuple[float, float]]:
    with servers(work, models, model, in_process) as (base_url, own_port):
        service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
        training = service.create_lora_training_client(base_model=model, rank=4).result(
            timeout=WAIT_S
        )
        tokenizer = training.get_tokenizer()
        # The config the front builds for the SDK's model (``ModelTable.create_model``).
        config = training_config({"base_model": model, "lora_config": {"rank": 4}})
        config = fit_lora_roles(fit_max_length(config, models / model), models / model)
        own = SessionClient(f"127.0.0.1:{own_port}", timeout_s=WAIT_S)
        own.wait_until_serving()
        own.open("bench", config)
        rows = token_rows(tokenizer, 32)
        batches = [rows[i : i + 8] for i in range(0, len(rows), 8)]
        sides = {"sdk": sdk_step(training), "own": own_step(own, "bench")}
        best = {name: (float("inf"), 0.0) for name in sides}
        for step in sides.values():  # warm up both
            step(batches[0])
        for _ in range(rounds):
            for name, step in sides.items():
                best[name] = min(best[name], timed(step, batches, steps))  # by wall time
        own.close_channel()
        service.close("success").result(timeout=WAIT_S)
    return best["sdk"], best["own"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    parser.add_argument("--in-process", action="store_true", help="the servers in this process")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Should the bench itself stall (past every bounded wait), its stacks, where it waits.
    faulthandler.dump_traceback_later(8 * 60)
    logging.basicConfig(level=logging.WARNING)
    rounds, steps = (2, 5) if args.quick else (5, 10)
    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        work = Path(tmp)
        models = work / "models"
        make_tiny_model(models / "tiny")
        make_tiny_model(models / "small", size="small")
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; batch 8, LoRA r=4; "
            + ("servers in this process" if args.in_process else "servers in their own processes")
        )
        print(
            f"{'model':<8}{'SDK ms/step':>14}{'own client ms/step':>20}{'ratio':>8}  goal"
            f"{'client CPU ms/step: SDK':>28}{'own':>8}"
        )
        for model, goal in (("tiny", 1.10), ("small", 1.02)):
            sdk, own = compare(model, models, work, rounds, steps, args.in_process)
            ratio = sdk[0] / own[0]
            print(
                f"{model:<8}{sdk[0] * 1e3:>14.2f}{own[0] * 1e3:>20.2f}{ratio:>8.3f}  <= {goal}"
                f"{sdk[1] * 1e3:>22.2f}{own[1] * 1e3:>8.2f}"
            )


if __name__ == "__main__":
    main()
