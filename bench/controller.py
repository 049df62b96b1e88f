"""The controller's replay against ManagedTraining in-process, and recovery after a restart.

    python bench/controller.py [--quick] [--window N]

1. One manifest (a small llama, 4 layers x 256 hidden, batch 8, checkpoint every 10 updates),
   run twice side by side: in-process (ManagedTraining + export + artifacts) and through the
   controller against a `trainwire serve` process on loopback (Open's model load excluded from
   both, as session construction is). Goal: ratio <= 1.10. Then the controller with a window
   (``--window``, default 4: operations pipelined). Goal: ratio <= 1.02.
2. Recovery: the server is SIGKILLed mid-run and restarted; seconds from the restart to the
   first resumed operation, against loading that checkpoint alone in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainwire.client import ManagedTrainingPlan, SessionClient, TrainingConfig
from trainwire.client.control.controller import Controller
from trainwire.contract.report.artifacts import write_run_artifacts
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import free_port, make_tiny_model, tiny_text_examples

CHECKPOINT_EVERY = 10
ROUNDS = 2


class Stop(Exception):
    pass


def long_examples(count: int):
    """Texts of roughly 100-150 tokens, built from the bundled examples."""
    pieces = tiny_text_examples(count * 6, seed=11)
    return [
        type(pieces[0])(" ".join(p.text for p in pieces[i * 6 : (i + 1) * 6])) for i in range(count)
    ]


def start_server(port: int, state: Path, model_root: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "trainwire", "serve", "--listen", f"127.0.0.1:{port}",
            "--state-dir", str(state), "--model-root", str(model_root),
            "--device", "cpu"]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def in_process(plan: ManagedTrainingPlan, work: Path, model_root: Path) -> float:
    session = TrainingSession(plan.config, max_steps=plan.max_steps, model_root=model_root)
    started = time.perf_counter()
    training = ManagedTraining(
        session, plan, checkpoint_dir=work / "checkpoints", checkpoint_every=CHECKPOINT_EVERY
    )
    result = training.run()
    training.export_weights(work / "export")
    write_run_artifacts(work, result, plan)
    return time.perf_counter() - started


def remote(
    plan: ManagedTrainingPlan, work: Path, client: SessionClient, run_id: str, window: int = 1
) -> float:
    client.open(run_id, plan.config, max_steps=plan.max_steps, plan_fingerprint=plan.fingerprint)
    started = time.perf_counter()
    Controller(
        client, plan, run_id=run_id, work_dir=work, checkpoint_every=CHECKPOINT_EVERY, window=window
    ).run()
    return time.perf_counter() - started


def run_until_stopped(
    client: SessionClient, plan: ManagedTrainingPlan, work: Path, on_step
) -> None:
    """Drive run "r" until ``on_step`` raises Stop (the controller dying there)."""
    controller = Controller(
        client, plan, run_id="r", work_dir=work, checkpoint_every=CHECKPOINT_EVERY
    )
    with contextlib.suppress(Stop):
        controller.run(on_step=on_step)


def recovery(plan: ManagedTrainingPlan, tmp: Path, model_root: Path) -> tuple[float, float, float]:
    """(restart → SERVING, restart → first resumed microbatch, checkpoint load in-process)."""
    port = free_port()
    state, work = tmp / "recovery-state", tmp / "recovery-work"
    server = start_server(port, state, model_root)
    client = SessionClient(f"127.0.0.1:{port}", timeout_s=120)
    client.wait_until_serving(timeout_s=120)
    stop_after = CHECKPOINT_EVERY + 2  # past the first checkpoint, before the end

    def stop(progress):
        if progress.microbatch == stop_after:
            raise Stop

    run_until_stopped(client, plan, work, stop)
    server.send_signal(signal.SIGKILL)
    server.wait()
    restarted = time.perf_counter()
    server = start_server(port, state, model_root)
    client.wait_until_serving(timeout_s=300)
    serving = time.perf_counter()
    first: list[float] = []

    def record_first(progress):
        if not first:
            first.append(time.perf_counter())
            raise Stop

    run_until_stopped(client, plan, work, record_first)
    server.send_signal(signal.SIGKILL)
    server.wait()
    client.close_channel()
    checkpoint = state / "runs" / "r" / "checkpoints" / "latest"
    load_started = time.perf_counter()
    session = TrainingSession(plan.config, max_steps=plan.max_steps, model_root=model_root)
    session.load_state(checkpoint)
    loaded = time.perf_counter()
    return serving - restarted, first[0] - restarted, loaded - load_started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer examples")
    parser.add_argument("--window", type=int, default=4, help="the pipelined side's window")
    args = parser.parse_args()
    count = 64 if args.quick else 96
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_root = tmp / "models"
        make_tiny_model(model_root / "small-llama", size="small")
        config = TrainingConfig(
            model="small-llama",
            batch_size=8,
            num_epochs=2,
            max_length=256,
            learning_rate=1e-4,
            shuffle=True,
        )
        plan = ManagedTrainingPlan(long_examples(count), config)
        # Alternate the sides, so warm-up and machine noise fall on both; keep each one's best.
        local_times, remote_times, windowed_times = [], [], []
        port = free_port()
        server = start_server(port, tmp / "state", model_root)
        try:
            client = SessionClient(
                f"127.0.0.1:{port}", timeout_s=120, max_in_flight=max(4, args.window)
            )
            client.wait_until_serving(timeout_s=120)
            for round_ in range(ROUNDS):
                local_times.append(in_process(plan, tmp / f"local-{round_}", model_root))
                remote_times.append(remote(plan, tmp / f"remote-{round_}", client, f"r{round_}"))
                client.close()  # ends the session: the next round opens a fresh one
                windowed_times.append(
                    remote(plan, tmp / f"window-{round_}", client, f"w{round_}", args.window)
                )
                client.close()
            client.close_channel()
        finally:
            server.send_signal(signal.SIGKILL)
            server.wait()
        local_s, remote_s = min(local_times), min(remote_times)
        serving_s, first_op_s, load_s = recovery(plan, tmp, model_root)
    print(f"manifest: {plan.batch_count} microbatches of 8, {plan.max_steps} updates, "
          f"checkpoint every {CHECKPOINT_EVERY}")  # fmt: skip
    rounds = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(local_times, remote_times, strict=True))
    print(f"rounds (in-process/remote)   {rounds} s")
    print(f"in-process ManagedTraining   {local_s:8.2f} s  (best round)")
    print(f"controller over loopback     {remote_s:8.2f} s  (best round)")
    print(f"ratio remote / in-process    {remote_s / local_s:8.3f}   (goal <= 1.10)")
    windowed_s = min(windowed_times)
    print(f"controller, window {args.window:<2}       {windowed_s:8.2f} s  (best round)")
    print(f"ratio window / in-process    {windowed_s / local_s:8.3f}   (goal <= 1.02)")
    print(f"restart -> SERVING           {serving_s:8.2f} s")
    print(f"restart -> first resumed op  {first_op_s:8.2f} s")
    print(f"checkpoint load in-process   {load_s:8.2f} s   (session build + load_state)")


if __name__ == "__main__":
    main()
