"""A real ``trainwire serve --tinker-listen`` process SIGKILLed in the middle of an SDK loop and
restarted on its state directory: the SDK's pending polls get the results an uninterrupted run
gives, and the loop ends with the same weights (the real SDK from PyPI, unchanged)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tinker
from service_fixtures import connect, wait_for
from slow_commit_serve import events
from tinker import types
from tinker_loops import KEY, SENTENCES, close_quietly, supervised_datum

from trainwire.server.service.request_records import CallRecord
from trainwire.server.service.request_store import read_records
from trainwire.testing import free_port

GRPC_TOKEN = "restart-grpc-token"


class TinkerServeProcess:
    """``python -m trainwire serve`` with the Tinker front on a fixed port (the SDK's
    ``base_url`` stays the same across a restart)."""

    def __init__(
        self,
        tmp: Path,
        state_dir: Path,
        model_root: Path,
        port: int,
        name: str,
        *,
        launcher: tuple[str, ...] = ("-m", "trainwire"),
        options: tuple[str, ...] = (),
    ) -> None:
        (tmp / "grpc-token").write_text(GRPC_TOKEN + "\n")
        (tmp / "tinker-key").write_text(KEY + "\n")
        self.port_file = tmp / f"{name}.port"
        self.log = tmp / f"{name}.log"
        command = [
            sys.executable, *launcher, "serve", "--listen", "127.0.0.1:0",
            "--state-dir", str(state_dir), "--model-root", str(model_root), "--device", "cpu",
            "--token-file", str(tmp / "grpc-token"), "--port-file", str(self.port_file),
            "--tinker-listen", f"127.0.0.1:{port}", "--tinker-token-file", str(tmp / "tinker-key"),
            *options,
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.port_file.exists() or self.process.poll() is not None, 120)
        assert self.process.poll() is None, self.log.read_text()
        self.grpc_port = int(self.port_file.read_text())

    def state_digest(self) -> str:
        with connect(self.grpc_port, token=GRPC_TOKEN) as client:
            return client.info().state_digest

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)


def logged_request_id(state_dir: Path, route: str, seq: int) -> str:
    """The request id of call ``seq``, a ``route``, in the front's request store."""
    (found,) = [call.request_id for call in stored_calls(state_dir, route) if call.seq == seq]
    return found


def stored_calls(state_dir: Path, route: str) -> list[CallRecord]:
    records = read_records(state_dir)
    return [r for r in records if isinstance(r, CallRecord) and r.answer == route]


def logged(state_dir: Path, route: str, seq: int) -> Callable[[], bool]:
    """True once the front's request store holds call ``seq``, a ``route``: accepted, its
    request id handed out."""

    def check() -> bool:
        return any(call.seq == seq for call in stored_calls(state_dir, route))

    return check


def sdk_loop(base_url: str, between: Callable[[int], None], steps: int = 5) -> list[Any]:
    """An RL-and-SL loop as the SDK's docs write it; ``between(step)`` runs after each step's
    forward_backward and optim_step were sent, before their results are awaited."""
    service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
    try:
        return run_loop(service, between, steps)
    finally:
        close_quietly(service)


def run_loop(service: tinker.ServiceClient, between: Callable[[int], None], steps: int) -> list:
    training_client = service.create_lora_training_client(base_model="llama", rank=4).result()
    tokenizer = training_client.get_tokenizer()
    prompt = tokenizer.encode("the cat")
    seen: list[Any] = []
    for step in range(steps):
        if step == 2:
            path = training_client.save_state("step-2").result().path
            seen.append(path.rsplit("/", 2)[-2:])  # the model id in it is the session's own
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=step)
        result = sampling_client.sample(types.ModelInput.from_ints(prompt), 2, params).result()
        data = [supervised_datum(tokenizer, SENTENCES[step % len(SENTENCES)])]
        for seq in result.sequences:
            full = prompt + seq.tokens
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens),
                    },
                )
            )
        scored_now = training_client.forward(data, "cross_entropy")  # a call the journal skips
        fwd_bwd = training_client.forward_backward(data, "cross_entropy")
        optim = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
        between(step)
        seen.append(scored_now.result().metrics["loss:sum"])
        output = fwd_bwd.result()
        seen.append([list(seq.tokens) for seq in result.sequences])
        seen.append([out["logprobs"].tolist() for out in output.loss_fn_outputs])
        seen.append(output.metrics["loss:sum"])
        seen.append(optim.result().metrics)
    scored = sampling_client.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    seen.append(scored)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("when", ["accepted", "in-flight"])
def test_a_server_killed_mid_loop_answers_the_sdks_polls_as_an_uninterrupted_run(
    tmp_path: Path, model_root: Path, tiny_llama: Path, when: str
) -> None:
    """``accepted``: the kill comes once the step's optim_step is in the request log (its poll
    is pending); ``in-flight``: at once, while the SDK may still be sending (it re-sends)."""
    started: list[TinkerServeProcess] = []
    try:
        port = free_port()
        plain_dir = tmp_path / "uninterrupted"
        plain_dir.mkdir()
        plain = TinkerServeProcess(plain_dir, plain_dir / "state", model_root, port, "plain")
        started.append(plain)
        expected = sdk_loop(f"http://127.0.0.1:{port}", lambda step: None)
        expected_digest = plain.state_digest()
        plain.kill()

        port = free_port()
        crash_dir = tmp_path / "interrupted"
        crash_dir.mkdir()
        state_dir = crash_dir / "state"
        first = TinkerServeProcess(crash_dir, state_dir, model_root, port, "first")
        started.append(first)
        restarted: list[TinkerServeProcess] = []

        def kill_and_restart(step: int) -> None:
            if step != 3:  # after the checkpoint at step 2: the calls since are rolled back
                return
            if when == "accepted":  # four calls a step (sampler, forward, fwd_bwd, optim) + save
                wait_for(logged(state_dir, "optim_step", 4 * (step + 1) + 1), 60)
            first.kill()
            second = TinkerServeProcess(crash_dir, state_dir, model_root, port, "second")
            started.append(second)
            restarted.append(second)

        interrupted = sdk_loop(f"http://127.0.0.1:{port}", kill_and_restart)
        assert len(restarted) == 1
        second_log = restarted[0].log.read_text()
        assert "restored at position" in second_log and "request records read back" in second_log
        assert interrupted == expected
        assert restarted[0].state_digest() == expected_digest
    finally:
        for process in started:
            process.kill()


SLOW_DISK = (str(Path(__file__).with_name("slow_commit_serve.py")), "3")


def save_behind_a_commit(service: tinker.ServiceClient, between: Callable[[], None]) -> list:
    """Two steps, the second's save sent behind its forward_backward before either is awaited;
    ``between()`` runs while the forward_backward's commit is (on a slow disk) on its way."""
    training_client = service.create_lora_training_client(base_model="llama", rank=4).result()
    tokenizer = training_client.get_tokenizer()
    seen: list[Any] = []
    for step, text in enumerate(SENTENCES[:2]):
        data = [supervised_datum(tokenizer, text)]
        fwd_bwd = training_client.forward_backward(data, "cross_entropy")
        if step == 1:
            save = training_client.save_state("behind")
            between()
            seen.append(save.result().path.rsplit("/", 2)[-2:])
        seen.append(fwd_bwd.result().metrics["loss:sum"])
        seen.append(
            training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics
        )
    return seen


def run_save_behind_a_commit(
    tmp: Path, model_root: Path, started: list[TinkerServeProcess], *, crash: bool
) -> tuple[list[Any], str]:
    """``save_behind_a_commit`` against a server of its own; with ``crash``, the server runs on
    a slow disk and is SIGKILLed (and restarted on the same port) while the save waits."""
    port, state_dir = free_port(), tmp / "state"
    tmp.mkdir()
    launcher = SLOW_DISK if crash else ("-m", "trainwire")
    servers = [TinkerServeProcess(tmp, state_dir, model_root, port, "first", launcher=launcher)]
    started.append(servers[0])

    def kill_and_restart() -> None:
        if not crash:
            return
        wait_for(logged(state_dir, "save_weights", 4), 60)  # the save is accepted, behind seq 3
        # Aimed by state: the forward_backward (seq 3) applied and its commit on the slow disk,
        # the save accepted behind it. On this transport a call runs once the one before it is
        # durable, so the save waits in seq_id order rather than at the journal.
        request_id = logged_request_id(state_dir, "forward_backward", 3)
        wait_for(lambda: f"commit {request_id}" in events(state_dir), 60)
        servers[0].kill()
        assert f"committed {request_id}" not in events(state_dir), "the kill landed too late"
        servers.append(TinkerServeProcess(tmp, state_dir, model_root, port, "second"))
        started.append(servers[-1])

    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
    try:
        seen = save_behind_a_commit(service, kill_and_restart)
    finally:
        close_quietly(service)
    if crash:
        assert len(servers) == 2 and "restored at position" in servers[1].log.read_text()
    return seen, servers[-1].state_digest()


@pytest.mark.slow
def test_a_server_killed_while_a_save_waits_behind_a_commit_answers_as_uninterrupted(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Issue 21.1 on the Tinker transport: the kill lands while a forward_backward's journal
    commit is on a slow disk and the save_state sent behind it waits its turn; after the restart
    the SDK's polls get an uninterrupted run's answers and the weights are the same."""
    started: list[TinkerServeProcess] = []
    try:
        expected = run_save_behind_a_commit(tmp_path / "plain", model_root, started, crash=False)
        crashed = run_save_behind_a_commit(tmp_path / "crash", model_root, started, crash=True)
        assert crashed == expected
    finally:
        for process in started:
            process.kill()
