"""The server's resident memory after a flood of maximal forward_backward calls, with and without
handing freed memory back to the system (``trainwire.server.memory_release``).

    python bench/resident_memory.py [--calls 60] [--datums 1024] [--tokens 255]

A ``trainwire serve`` process with the Tinker front (tiny llama, CPU) and one model open; after a
small call warmed it, ``--calls`` forward_backward calls of ``--datums`` datums of ``--tokens``
tokens (the most a valid call holds for this model: its 256 positions) are sent in seq_id order
without awaiting them, as a pipelining SDK client sends them: the first runs while the others
wait (what the queued-bytes bound takes) or are refused (429). Once every accepted call has its
result, the server's RSS (``VmRSS`` in ``/proc/PID/status``) is read again. Each setting gets
its own server process; ``TRAINWIRE_KEEP_FREED_MEMORY=1`` is the one without the release.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from trainwire.server.memory_release import KEEP_FREED_MEMORY_ENV
from trainwire.testing import free_port, make_tiny_model

KEY = "tml-trainwire-bench"
HEADERS = {"X-API-Key": KEY}
START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Figures:
    """One server's resident memory (MiB) at the three moments, and what the flood did."""

    before_mib: float
    peak_mib: float
    after_mib: float
    accepted: int
    refused: int
    seconds: float


def resident_mib(pid: int, field: str = "VmRSS") -> float:
    """A ``/proc/PID/status`` memory field of process ``pid``, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


@contextlib.contextmanager
def serve_process(tmp: Path, models: Path, *, release: bool) -> Iterator[tuple[int, str]]:
    """``trainwire serve`` with the Tinker front: its pid and the front's API base URL."""
    state = tmp / ("state-release" if release else "state-keep")
    port_file, key_file = tmp / f"{state.name}.port", tmp / "key"
    key_file.write_text(KEY + "\n")
    tinker_port = free_port()
    command = [
        sys.executable, "-m", "trainwire", "serve", "--listen", "127.0.0.1:0",
        "--state-dir", str(state), "--model-root", str(models), "--device", "cpu",
        "--port-file", str(port_file), "--tinker-listen", f"127.0.0.1:{tinker_port}",
        "--tinker-token-file", str(key_file),
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != KEEP_FREED_MEMORY_ENV}
    if not release:
        env[KEEP_FREED_MEMORY_ENV] = "1"
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("trainwire serve did not start")
            time.sleep(0.1)
        yield process.pid, f"http://127.0.0.1:{tinker_port}/api/v1"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def forward_backward_bodies(model_id: str, seqs: range, datums: int, tokens: int) -> list[bytes]:
    """SDK protobuf bodies, one per seq_id, of ``datums`` datums of ``tokens`` tokens (ids past
    the small ints Python shares, so each decoded id is an object of its own)."""
    ids = np.random.default_rng(0).integers(257, 500, size=(datums, tokens + 1))
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:].tolist(), "weights": [0.5] * tokens},
        )
        for row in ids
    ]
    request = types.ForwardBackwardRequest(
        types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"), model_id, seqs[0]
    )
    message = forward_backward_request_to_proto(request)
    bodies = []
    for seq in seqs:
        message.seq_id = seq
        bodies.append(message.SerializeToString())
    return bodies


class Front:
    """Raw HTTP to the front, as the SDK sends it."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.http = httpx.Client(headers=HEADERS, timeout=CALL_TIMEOUT_S)
        session_id = self.post("create_session", {}).json()["session_id"]
        created = self.post("create_model", {"session_id": session_id, "base_model": "llama"})
        self.model_id: str = created.json()["model_id"]

    def post(self, route: str, body: object) -> httpx.Response:
        response = self.http.post(f"{self.base}/{route}", json=body)
        response.raise_for_status()
        return response

    def send(self, body: bytes) -> str | None:
        """The request id of a forward_backward, or None when it was refused (429)."""
        response = self.http.post(
            f"{self.base}/forward_backward",
            content=body,
            headers={"Content-Type": "application/x-protobuf"},
        )
        if response.status_code == 429:
            return None
        response.raise_for_status()
        return str(response.json()["request_id"])

    def await_result(self, request_id: str) -> None:
        """Poll until the call's result is there (a forward_backward's comes as protobuf)."""
        while True:
            response = self.post("retrieve_future", {"request_id": request_id})
            if not response.headers.get("content-type", "").startswith("application/json"):
                return
            answer = response.json()
            if answer.get("type") != "try_again":
                if "loss_fn_outputs" not in answer:
                    raise RuntimeError(f"{request_id} failed: {answer}")
                return


def flood(models: Path, tmp: Path, args: argparse.Namespace, *, release: bool) -> Figures:
    with serve_process(tmp, models, release=release) as (pid, base):
        front = Front(base)
        (warm,) = forward_backward_bodies(front.model_id, range(1, 2), 1, 8)
        warm_id = front.send(warm)
        assert warm_id is not None
        front.await_result(warm_id)
        seqs = range(2, 2 + args.calls)
        bodies = forward_backward_bodies(front.model_id, seqs, args.datums, args.tokens)
        before = resident_mib(pid)
        started = time.monotonic()
        accepted = [request_id for body in bodies if (request_id := front.send(body))]
        del bodies
        for request_id in accepted:
            front.await_result(request_id)
        seconds = time.monotonic() - started
        time.sleep(1.0)  # let the finishing thread drop the last result's buffers
        return Figures(
            before,
            resident_mib(pid, "VmHWM"),
            resident_mib(pid),
            len(accepted),
            args.calls - len(accepted),
            seconds,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="forward_backward calls sent")
    parser.add_argument("--datums", type=int, default=1024, help="datums per call")
    parser.add_argument("--tokens", type=int, default=255, help="tokens per datum")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        models = Path(tmp) / "models"
        make_tiny_model(models / "llama")
        figures = {
            "kept by malloc": flood(models, Path(tmp), args, release=False),
            "handed back": flood(models, Path(tmp), args, release=True),
        }
    print(
        f"{args.calls} forward_backward calls of {args.datums} x {args.tokens} tokens "
        "behind a running one, server RSS in MiB"
    )
    print(f"{'freed memory':<16}{'before':>9}{'peak':>9}{'after':>9}{'growth':>9}"
          f"{'accepted':>10}{'refused':>9}{'seconds':>9}")  # fmt: skip
    for name, f in figures.items():
        print(
            f"{name:<16}{f.before_mib:>9.0f}{f.peak_mib:>9.0f}{f.after_mib:>9.0f}"
            f"{f.after_mib - f.before_mib:>9.0f}{f.accepted:>10}{f.refused:>9}{f.seconds:>9.1f}"
        )


if __name__ == "__main__":
    main()
