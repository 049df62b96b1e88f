"""What the service costs: remote vs in-process steps, the journal's commit, export streaming.

    python bench/service.py [--quick]

Measured side by side in one run, in one process (the server on a loopback port, its client in
the same interpreter), alternating the two sides round by round so machine noise hits both:

1. ForwardBackward + OptimStep on the tiny model (overhead-dominated): µs added per operation,
   and the journal's durable commit (SQLite WAL, synchronous=FULL) timed on its own.
2. The same on a small llama (4 layers × 256 hidden, batch 8 × ~128 tokens). Goal: remote /
   in-process ≤ 1.05.
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
from pathlib import Path

import grpc

from trainwire.client import InputExample, SessionClient, TrainingConfig, wire
from trainwire.server import TrainingSession, serve
from trainwire.server.journal import Journal, JournalEntry
from trainwire.server.state_dir import CHUNK_BYTES
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


def compare_steps(config: TrainingConfig, examples, model_root: Path, state_dir: Path,
                  rounds: int, steps: int, batch: int) -> tuple[float, float]:  # fmt: skip
    """Seconds per (ForwardBackward + OptimStep), in-process and remote."""
    max_steps = rounds * steps + 1
    local = TrainingSession(config, device="cpu", max_steps=max_steps, model_root=model_root)
    handle = serve(listen="127.0.0.1:0", state_dir=state_dir, model_root=model_root, device="cpu")
    client = SessionClient(f"127.0.0.1:{handle.port}")
    client.wait_until_serving()
    client.open("bench", config, max_steps=max_steps)
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
    client.close_channel()
    handle.stop()
    return min(local_rounds), min(remote_rounds)


def journal_commit_s(directory: Path, count: int) -> float:
    """Median seconds of one durable journal commit with a typical result."""
    with Journal(directory / "journal.sqlite3") as journal:
        times = []
        for i in range(count):
            result = {"operation_key": f"k{i}", "position": i + 1, "state_digest": "", "loss": 1.5}
            entry = JournalEntry(f"k{i}", "ForwardBackward", "sha256:" + "0" * 64, i + 1, result)
            started = time.perf_counter()
            journal.record(entry)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


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
    directory = handle.host.state_dir.run("export").export("final")
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
            if hashing and isinstance(item, wire.RawChunk):
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
            "final", operation_key="export", download_to=work / "download"
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
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rounds, tiny_steps, small_steps, stream_rounds = (3, 10, 2, 3) if args.quick else (7, 30, 5, 9)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = work / "models"
        make_tiny_model(models / "tiny")
        make_llama(models / "small", SMALL_LLAMA)
        make_llama(models / "export", EXPORT_LLAMA)
        tiny = TrainingConfig(model="tiny", batch_size=4, max_length=64, learning_rate=1e-3)
        small = TrainingConfig(model="small", batch_size=8, max_length=256, learning_rate=1e-4)
        tiny_local, tiny_remote = compare_steps(
            tiny, tiny_text_examples(64), models, work / "s1", rounds, tiny_steps, 4
        )
        commit = journal_commit_s(work / "journal", 200 if not args.quick else 50)
        small_local, small_remote = compare_steps(
            small, long_examples(32, 128), models, work / "s2", rounds, small_steps, 8
        )
        streams, size = compare_streams(small.replace(model="export"), models, work, stream_rounds)
    added_us = (tiny_remote - tiny_local) / 2 * 1e6
    rows = [
        ("tiny model: ForwardBackward + OptimStep (ms/step)", f"{tiny_local * 1e3:.2f}",
         f"{tiny_remote * 1e3:.2f}", f"{tiny_remote / tiny_local:.2f}", f"best of {rounds} rounds"),
        ("  added per operation (µs)", "", f"{added_us:.0f}", "", ""),
        ("  journal commit alone (µs; share of the added)", "", f"{commit * 1e6:.0f}",
         f"{commit * 1e6 / added_us:.0%}", "WAL, synchronous=FULL"),
        ("small llama 4x256, batch 8 x ~128 tokens (ms/step)", f"{small_local * 1e3:.1f}",
         f"{small_remote * 1e3:.1f}", f"{small_remote / small_local:.3f}", "goal <= 1.05"),
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
