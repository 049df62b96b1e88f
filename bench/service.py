"""What the service costs: remote vs in-process steps, the ledger's commit, export streaming.

    python bench/service.py [--quick] [--threads N]

Measured side by side in one run, in one process (the server on a loopback port, its client in
the same interpreter), alternating the two sides round by round so machine noise hits both:

1. ForwardBackward + OptimStep on the tiny model (overhead-dominated): µs added per operation,
   the ledger's durable commits (SQLite WAL, synchronous=FULL) timed inside the server during
   those steps, and a replayed call's round trip (the service without the engine). Then blocks
   of steps in a row, in-process vs pipelined (``*_async``, 4 in flight). Goal: ≤ 1.10.
2. The same on a small llama (4 layers × 256 hidden, batch 8 × ~128 tokens). Goal: remote /
   in-process ≤ 1.05; pipelined ≤ 1.02.
3. The ExportWeights stream (a replayed export of a ~100 MB llama) vs a raw gRPC stream of the
   same bytes in the same 1 MiB chunks (no protobuf, no hashing). Goal: ≥ 0.8×. Also shown: the
   stream with every byte's sha256 checked, and the client's whole download (verified, written,
   fsynced, renamed into place) vs the raw stream written to a file and fsynced.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from trainwire.client import InputExample, SessionClient, TrainingConfig
from trainwire.contract import chunks
from trainwire.server import TrainingSession, serve
from trainwire.server.service.ledger import Ledger
from trainwire.server.service.state_dir import CHUNK_BYTES
from trainwire.testing import make_tiny_model, tiny_text_examples
from trainwire.v1 import session_pb2 as pb

SMALL_LLAMA = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "intermediate_size": 688}  # fmt: skip
# About 100 MB of fp32 weights: enough bytes for a sustained streaming figure.
EXPORT_LLAMA = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 8, "intermediate_size": 1376}  # fmt: skip


def make_llama(directory: Path, shape: dict[str, int]) -> Path:
    """The tiny model's tokenizer with a llama of ``shape`` behind it, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    make_tiny_model(directory)
    config = LlamaConfig.from_pretrained(directory)
    for name, value in shape.items():
        setattr(config, name, value)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def long_examples(count: int, tokens: int) -> list[InputExample]:
    """Texts of about ``tokens`` tokens, built from the tiny corpus sentences."""
    pool = [e.text for e in tiny_text_examples(200, seed=7)]
    out = []
    for i in range(count):
        text = ""
        j = i
        while len(text.split()) < tokens * 0.4:  # about 2.5 tokens a word
            text += " " + pool[j % len(pool)]
            j += 3
        out.append(InputExample(text.strip()))
    return out


def _timed(call: Callable[[int], None], i: int) -> float:
    started = time.perf_counter()
    call(i)
    return time.perf_counter() - started


@dataclass
class StepFigures:
    """Seconds per (ForwardBackward + OptimStep) in-process and remote, per replayed call, and
    per ledger commit during the remote steps."""

    local_s: float
    remote_s: float
    replay_s: float
    info_s: float  # an Info read's round trip: no journal, no engine
    raw_s: float  # a bare gRPC unary call's round trip (1 KiB echoed), no trainwire code
    commit_s: float
    local_block_s: float  # a block of steps in a row, per step
    pipelined_block_s: float  # the same block pipelined (futures, max_in_flight 4), per step


def compare_steps(config: TrainingConfig, examples, model_root: Path, state_dir: Path,
                  rounds: int, steps: int, batch: int) -> StepFigures:  # fmt: skip
    """Time both sides on the same batches; see ``StepFigures``."""
    max_steps = rounds * steps + 1
    local = TrainingSession(config, device="cpu", max_steps=max_steps, model_root=model_root)
    handle = serve(listen="127.0.0.1:0", state_dir=state_dir, model_root=model_root, device="cpu")
    client = SessionClient(f"127.0.0.1:{handle.port}")
    client.wait_until_serving()
    client.open("bench", config, max_steps=max_steps)
    commits = timed_commits(handle.session_host.ledger)
    batches = [examples[(i * batch) % len(examples) :][:batch] for i in range(len(examples))]

    def local_step(i: int) -> None:
        local.forward_backward(batches[i % len(batches)])
        local.optim_step()

    position = 0

    def remote_step(i: int) -> None:
        nonlocal position
        client.forward_backward(
            batches[i % len(batches)], operation_key=f"fb/{i}", expected_position=position
        )
        step = client.optim_step(operation_key=f"opt/{i}", expected_position=position + 1)
        position = step.position

    # Rounds of blocks, alternating the sides; each block's first step (the switch between two
    # sessions' caches and threads) is not timed. Other load on the machine only ever adds time,
    # so each side's figure is its best round's median (as timeit takes the best of its repeats).
    local_rounds, remote_rounds = [], []
    for r in range(rounds):
        local_step(-1 - r)
        local_rounds.append(
            statistics.median(_timed(local_step, r * steps + i) for i in range(steps))
        )
        remote_step(-1 - r)
        remote_rounds.append(
            statistics.median(_timed(remote_step, r * steps + i) for i in range(steps))
        )

    # Blocks of steps in a row: in-process, and remote with every call issued at once (futures,
    # at most 4 on the wire) and only the last one awaited.
    def local_block(r: int) -> None:
        for i in range(steps):
            local_step(10_000 + r * steps + i)

    def pipelined_block(r: int) -> None:
        nonlocal position
        last = None
        for i in range(steps):
            batch = batches[(r * steps + i) % len(batches)]
            key = 10_000 + r * steps + i
            client.forward_backward_async(
                batch, operation_key=f"fb/{key}", expected_position=position
            )
            last = client.optim_step_async(
                operation_key=f"opt/{key}", expected_position=position + 1
            )
            position += 2
        last.result()

    local_blocks, pipelined_blocks = [], []
    for r in range(rounds):
        local_blocks.append(_timed(local_block, r) / steps)
        pipelined_blocks.append(_timed(pipelined_block, r) / steps)
    # The service alone: a retried key, answered from the journal (no engine, no commit).
    replay = statistics.median(
        _timed(lambda i: client.forward_backward(batches[0], operation_key="fb/0"), i)
        for i in range(50)
    )
    info = statistics.median(_timed(lambda i: client.info(), i) for i in range(50))
    raw = raw_unary_round_trip(50)
    client.close_channel()
    handle.stop()
    return StepFigures(
        min(local_rounds),
        min(remote_rounds),
        replay,
        info,
        raw,
        statistics.median(commits),
        min(local_blocks),
        min(pipelined_blocks),
    )


def timed_commits(ledger: Ledger) -> list[float]:
    """Times every durable write the server's ``ledger`` makes from now on: one transaction,
    one fsync, for however many writes the group commit gathered."""
    commits: list[float] = []
    transact = ledger._transact

    def timed_transact(writes) -> list:
        started = time.perf_counter()
        outcomes = transact(writes)
        commits.append(time.perf_counter() - started)
        return outcomes

    ledger._transact = timed_transact  # an instance attribute: this ledger only
    return commits


def raw_unary_round_trip(calls: int) -> float:
    """Median seconds of a bare gRPC unary call on loopback (1 KiB echoed; a server with the
    service's thread pool size): what gRPC itself costs a call here, before any trainwire code."""
    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, _: request)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    echo = channel.unary_unary("/bench.Raw/Echo")
    payload = b"x" * 1024
    try:
        echo(payload)  # connect
        return statistics.median(_timed(lambda i: echo(payload), i) for i in range(calls))
    finally:
        channel.close()
        server.stop(None)


def raw_stream_server(files: list[Path]) -> tuple[grpc.Server, int]:
    """A bare gRPC server streaming the files' bytes in 1 MiB chunks: no protos, no hashing."""

    def stream(request: bytes, context) -> object:
        for path in files:
            with open(path, "rb") as handle:
                while data := handle.read(CHUNK_BYTES):
                    yield data

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def compare_streams(config: TrainingConfig, model_root: Path, work: Path, rounds: int):
    """MB/s of the export stream (as received; + sha256; full download) and of raw streams."""
    handle = serve(listen="127.0.0.1:0", state_dir=work / "state", model_root=model_root,
                   device="cpu")  # fmt: skip
    client = SessionClient(f"127.0.0.1:{handle.port}")
    client.wait_until_serving()
    client.open("export", config, max_steps=1)
    exported = client.export_weights("final", operation_key="export")
    directory = handle.session_host.state_dir.run("export").export("final")
    size = sum(f.size_bytes for f in exported.files)
    raw, port = raw_stream_server([directory / f.path for f in exported.files])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    fetch = channel.unary_stream("/bench.Raw/Stream")
    request = pb.ExportWeightsRequest(
        operation=pb.Operation(operation_key="export"), name="final", download=True
    )

    def stream(hashing: bool) -> None:
        digest = hashlib.sha256()
        for item in client._export_stream(request):
            if hashing and isinstance(item, chunks.RawChunk):
                digest.update(item.data)

    def raw_to_disk() -> None:
        with open(work / "raw.bin", "wb") as out:
            for chunk in fetch(b""):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())

    runs = {
        "raw": lambda: sum(len(chunk) for chunk in fetch(b"")),
        "stream": lambda: stream(False),
        "stream+sha256": lambda: stream(True),
        "raw to disk": raw_to_disk,
        "download": lambda: client.export_weights(
            "final", operation_key="export", download_to=work / "download", replace=True
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds + 1):  # the first round warms up
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            if r:
                times[name].append(time.perf_counter() - started)
    channel.close()
    raw.stop(None)
    client.close_channel()
    handle.stop()
    return {name: size / min(t) / 1e6 for name, t in times.items()}, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's, one per core)"
    )
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    rounds, tiny_steps, small_steps, stream_rounds = (3, 10, 2, 3) if args.quick else (7, 30, 5, 9)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        make_tiny_model(models / "tiny")
        make_llama(models / "small", SMALL_LLAMA)
        make_llama(models / "export", EXPORT_LLAMA)
        tiny_config = TrainingConfig(model="tiny", batch_size=4, max_length=64, learning_rate=1e-3)
        small_config = TrainingConfig(
            model="small", batch_size=8, max_length=256, learning_rate=1e-4
        )
        tiny = compare_steps(
            tiny_config, tiny_text_examples(64), models, work / "s1", rounds, tiny_steps, 4
        )
        small = compare_steps(
            small_config, long_examples(32, 128), models, work / "s2", rounds, small_steps, 8
        )
        export_config = small_config.replace(model="export")
        streams, size = compare_streams(export_config, models, work, stream_rounds)
    added_us = (tiny.remote_s - tiny.local_s) / 2 * 1e6
    rows = [
        ("tiny model: ForwardBackward + OptimStep (ms/step)", f"{tiny.local_s * 1e3:.2f}",
         f"{tiny.remote_s * 1e3:.2f}", f"{tiny.remote_s / tiny.local_s:.2f}",
         f"best of {rounds} rounds"),
        ("  added per operation (µs)", "", f"{added_us:.0f}", "", ""),
        ("  of which the ledger's commit (µs; share)", "", f"{tiny.commit_s * 1e6:.0f}",
         f"{tiny.commit_s * 1e6 / added_us:.0%}", "WAL, synchronous=FULL"),
        ("  a replayed call's round trip, for scale (µs; share)", "",
         f"{tiny.replay_s * 1e6:.0f}", f"{tiny.replay_s * 1e6 / added_us:.0%}",
         "gRPC + journal lookup, no engine"),
        ("  an Info read's round trip, for scale (µs)", "", f"{tiny.info_s * 1e6:.0f}", "",
         "no journal, no engine"),
        ("  a bare gRPC unary call's round trip (µs)", "", f"{tiny.raw_s * 1e6:.0f}", "",
         "1 KiB echoed, no trainwire code"),
        ("  pipelined, 4 in flight (ms/step, blocks in a row)", f"{tiny.local_block_s * 1e3:.2f}",
         f"{tiny.pipelined_block_s * 1e3:.2f}",
         f"{tiny.pipelined_block_s / tiny.local_block_s:.2f}", "goal <= 1.10"),
        ("small llama 4x256, batch 8 x ~128 tokens (ms/step)", f"{small.local_s * 1e3:.1f}",
         f"{small.remote_s * 1e3:.1f}", f"{small.remote_s / small.local_s:.3f}", "goal <= 1.05"),
        ("  pipelined, 4 in flight (ms/step, blocks in a row)",
         f"{small.local_block_s * 1e3:.1f}", f"{small.pipelined_block_s * 1e3:.1f}",
         f"{small.pipelined_block_s / small.local_block_s:.3f}", "goal <= 1.02"),
        (f"export stream as received (MB/s, {size / 1e6:.1f} MB)", f"{streams['raw']:.0f}",
         f"{streams['stream']:.0f}", f"{streams['stream'] / streams['raw']:.2f}", "goal >= 0.8"),
        ("  + sha256 of every byte (MB/s)", f"{streams['raw']:.0f}",
         f"{streams['stream+sha256']:.0f}", f"{streams['stream+sha256'] / streams['raw']:.2f}", ""),
        ("  full download: verified, fsynced, renamed (MB/s)", f"{streams['raw to disk']:.0f}",
         f"{streams['download']:.0f}", f"{streams['download'] / streams['raw to disk']:.2f}",
         "raw written + fsynced"),
    ]  # fmt: skip
    print(f"{'figure':<56}{'in-process/raw':>16}{'remote/ours':>13}{'ratio':>8}  note")
    for figure, left, right, ratio, note in rows:
        print(f"{figure:<56}{left:>16}{right:>13}{ratio:>8}  {note}")


if __name__ == "__main__":
    main()
