"""A real ``trainwire serve`` process killed with SIGKILL, restarted on its state directory, read
with SIGUSR1 and stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from ledger_files import opened_journal
from service_fixtures import (
    TEXTS,
    apply_remote,
    connect,
    running_server,
    training_ops,
    wait_for,
)
from slow_commit_serve import events

from trainwire.contract import outcomes

TOKEN = "restart-token"


class ServeProcess:
    """``python -m trainwire serve`` on a free port, its log in ``log``."""

    def __init__(
        self,
        tmp_path: Path,
        state_dir: Path,
        model_root: Path,
        name: str,
        *,
        launcher: tuple[str, ...] = ("-m", "trainwire"),
        extra: tuple[str, ...] = (),
    ) -> None:
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        self.port_file = tmp_path / f"{name}.port"
        self.log = tmp_path / f"{name}.log"
        command = [
            sys.executable, *launcher, "serve", "--listen", "127.0.0.1:0",
            "--state-dir", str(state_dir), "--model-root", str(model_root), "--device", "cpu",
            "--token-file", str(token_file), "--port-file", str(self.port_file), *extra,
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.port_file.exists() or self.process.poll() is not None, 120)
        assert self.process.poll() is None, self.log.read_text()
        self.port = int(self.port_file.read_text())

    def stop(self, signum: int) -> int:
        os.kill(self.process.pid, signum)
        return self.process.wait(timeout=60)

    def kill_if_running(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=60)


@pytest.fixture
def processes():
    started: list[ServeProcess] = []
    yield started
    for process in started:
        process.kill_if_running()


@pytest.mark.slow
def test_a_server_killed_after_a_checkpoint_restarts_there_and_replays_to_the_same_bits(
    tmp_path, model_root, llama_config, processes
):
    state_dir = tmp_path / "state"
    ops = training_ops(TEXTS[:12])  # fb fb optim fb fb optim
    first = ServeProcess(tmp_path, state_dir, model_root, "first")
    processes.append(first)
    with connect(first.port, token=TOKEN) as client:
        client.open("run", llama_config(), max_steps=4)
        before = apply_remote(client, ops[:3], "run")
        saved = client.save_state("c1", operation_key="save", expected_position=3)
        uninterrupted = apply_remote(client, ops, "run", first=3, position=4)
        final = client.info()
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL

    second = ServeProcess(tmp_path, state_dir, model_root, "second")
    processes.append(second)
    with connect(second.port, token=TOKEN) as client:  # waits through NOT_SERVING
        info = client.info()
        assert (info.state, info.position, info.step) == (outcomes.OPEN, 4, 1)
        assert (info.restored_checkpoint, info.last_operation_key) == ("c1", "save")
        assert info.state_digest == saved.state_digest
        early = client.forward_backward(ops[0][1], operation_key="run/0", expected_position=0)
        assert early.replayed and early.loss == before[0].loss
        replayed = apply_remote(client, ops, "run", first=3, position=4)
        assert [o.replayed for o in replayed] == [False, False, False]
        assert replayed == uninterrupted
        assert client.info().state_digest == final.state_digest

    os.kill(second.process.pid, signal.SIGUSR1)  # every thread's stack to stderr; it serves on
    wait_for(lambda: "serve_command.py" in second.log.read_text(), 30)
    assert "(most recent call first)" in second.log.read_text()
    with connect(second.port, token=TOKEN) as client:
        assert client.info().state_digest == final.state_digest
    assert second.stop(signal.SIGTERM) == 0
    log = second.log.read_text()
    assert "restored at position 4 (checkpoint c1" in log
    assert "SIGTERM received" in log and f"listening on 127.0.0.1:{second.port}" in log
    with opened_journal(state_dir, "run") as journal:
        entries = journal.entries(include_rolled_back=True)
    assert [(e.operation_key, e.position, e.rolled_back) for e in entries] == [
        ("run/0", 1, False),
        ("run/1", 2, False),
        ("run/2", 3, False),
        ("save", 4, False),
        ("run/3", 5, False),
        ("run/4", 6, False),
        ("run/5", 7, False),
    ]


SLOW_DISK = (str(Path(__file__).with_name("slow_commit_serve.py")), "3")


def until_the_kill(call) -> None:
    """Run ``call``; the SIGKILL ends it with an error (its channel closes under it)."""
    with contextlib.suppress(grpc.RpcError, ValueError):
        call()


@pytest.mark.slow
def test_a_server_killed_while_a_save_waits_for_an_earlier_commit_replays_exactly_once(
    tmp_path, model_root, llama_config, processes
):
    """Issue 21.1: the save may not write a checkpoint holding an operation whose journal entry
    a crash could still lose; killed in that window, the run still ends with the same bits."""
    ops = training_ops(TEXTS[:12])  # fb fb optim fb fb optim
    with (
        running_server(tmp_path / "reference", model_root) as reference,
        connect(reference) as client,
    ):
        client.open("run", llama_config(), max_steps=4)
        apply_remote(client, ops[:1], "run")
        client.save_state("c1", operation_key="save", expected_position=1)
        apply_remote(client, ops, "run", first=1, position=2)
        uninterrupted = client.info().state_digest

    state_dir = tmp_path / "state"
    slow = ServeProcess(tmp_path, state_dir, model_root, "slow", launcher=SLOW_DISK)
    processes.append(slow)
    trainer, saver = connect(slow.port, token=TOKEN), connect(slow.port, token=TOKEN)
    trainer.open("run", llama_config(), max_steps=4)
    calls = [
        lambda: trainer.forward_backward(ops[0][1], operation_key="run/0", expected_position=0),
        lambda: saver.save_state("c1", operation_key="save", expected_position=1),
    ]
    for call in calls:  # the save is held at the position gate until run/0 is applied
        threading.Thread(target=until_the_kill, args=(call,), daemon=True).start()
    # Aimed by state: run/0 applied and its commit on the slow disk, the save waiting behind it.
    wait_for(lambda: {"commit run/0", "durable-wait"} <= set(events(state_dir)), 60)
    assert slow.stop(signal.SIGKILL) == -signal.SIGKILL
    assert "committed run/0" not in events(state_dir), "the kill landed after the commit"
    trainer.close_channel()
    saver.close_channel()
    checkpoints = state_dir / "runs" / "run" / "checkpoints"
    assert not (checkpoints / "c1").exists(), "the save wrote a checkpoint before the commit"
    with opened_journal(state_dir, "run") as journal:
        assert journal.lookup("run/0") is None  # the kill landed before the commit

    second = ServeProcess(tmp_path, state_dir, model_root, "second")
    processes.append(second)
    with connect(second.port, token=TOKEN) as client:
        apply_remote(client, ops[:1], "run")
        client.save_state("c1", operation_key="save", expected_position=1)
        apply_remote(client, ops, "run", first=1, position=2)
        assert client.info().state_digest == uninterrupted
