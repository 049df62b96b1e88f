"""The ledger the state directory created is never opened as a new one: cut to zero bytes (its
-wal gone too), missing, or with an index page overwritten, it stops ``trainwire serve`` at start,
in one line naming the file and what to do; moving it aside as that line says starts afresh (real
``trainwire serve`` processes on a state directory a real SDK run wrote). It holds every run's
journal, so a server of gRPC runs, of one run or of many, stops the same way: no run is restored
with no record of the keys it applied."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import connect, running_server, wait_for
from tinker import types
from tinker_loops import KEY, SENTENCES, service_client, supervised_datum, tinker_server

from trainwire.client import LoraSettings
from trainwire.server.service.ledger import LEDGER_FILE, ledger_path
from trainwire.testing import tiny_text_examples

# Real serve processes started on damaged state directories: with the crash and restart tests.
pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180.0
TEXTS = tiny_text_examples(2)


@dataclass
class ServeOutcome:
    """How a ``trainwire serve`` process ended up: serving (its port written), or exited."""

    serving: bool
    returncode: int | None
    stderr: str


def start_serve(
    tmp: Path, state_dir: Path, model_root: Path, *, tinker: bool = True, max_runs: int = 1
) -> ServeOutcome:
    """Start ``trainwire serve`` on ``state_dir`` (with the Tinker front, or gRPC only, holding
    ``max_runs``); once it serves, stop it (SIGTERM). What it wrote to stderr comes back either
    way."""
    (tmp / "tinker-key").write_text(KEY + "\n")
    port_file, log = tmp / "serve.port", tmp / "serve.stderr"
    port_file.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "trainwire", "serve", "--listen", "127.0.0.1:0",
        "--state-dir", str(state_dir), "--model-root", str(model_root), "--device", "cpu",
        "--port-file", str(port_file), "--max-runs", str(max_runs),
    ]  # fmt: skip
    if tinker:
        command += [
            "--tinker-listen",
            "127.0.0.1:0",
            "--tinker-token-file",
            str(tmp / "tinker-key"),
            "--token-file",  # a keyed front never stands beside an open gRPC port
            str(tmp / "tinker-key"),
        ]
    with open(log, "wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for(lambda: port_file.exists() or process.poll() is not None, START_TIMEOUT_S)
        serving = process.poll() is None
        if serving:
            os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
    return ServeOutcome(serving, None if serving else process.returncode, log.read_text())


@pytest.fixture(scope="module")
def trained_state(
    tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path
) -> Path:
    """A state directory an SDK run wrote: a model, two training calls, a stopped server."""
    state_dir = tmp_path_factory.mktemp("trained") / "state"
    with tinker_server(state_dir, model_root) as server:
        training = service_client(server).create_lora_training_client("llama", rank=4).result()
        datum = supervised_datum(training.get_tokenizer(), SENTENCES[0])
        training.forward_backward([datum], "cross_entropy").result(timeout=60)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    db = sqlite3.connect(ledger_path(state_dir))  # all in the main file: a page there is the page
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return state_dir


@pytest.fixture
def state_dir(tmp_path: Path, trained_state: Path) -> Path:
    copy = tmp_path / "state"
    shutil.copytree(trained_state, copy)
    return copy


def cut_to_zero_bytes(store: Path) -> None:
    store.write_bytes(b"")
    for suffix in ("-wal", "-shm"):
        store.with_name(store.name + suffix).unlink(missing_ok=True)


def overwrite_an_index_page(store: Path) -> None:
    """Garbage over the root page of the store's index (the table's pages stay readable)."""
    db = sqlite3.connect(store)
    (page_size,) = db.execute("PRAGMA page_size").fetchone()
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE type = 'index'").fetchone()
    db.close()
    with open(store, "r+b") as handle:
        handle.seek((root - 1) * page_size)
        handle.write(bytes(range(256)) * (page_size // 256))


def assert_stopped_naming(
    outcome: ServeOutcome, store: Path, problem: str, what: str = "the ledger"
) -> None:
    assert not outcome.serving, f"serve started on a damaged store ({what})"
    assert outcome.returncode != 0
    lines = outcome.stderr.strip().splitlines()
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert lines[-1].startswith(f"trainwire serve: error: {what} {store} {problem}")
    assert f"move {store.name}* aside" in lines[-1] and "restore it" in lines[-1]


def test_a_ledger_cut_to_zero_bytes_stops_serve_naming_the_file(
    tmp_path: Path, state_dir: Path, model_root: Path
) -> None:
    store = ledger_path(state_dir)
    cut_to_zero_bytes(store)
    outcome = start_serve(tmp_path, state_dir, model_root)
    assert_stopped_naming(outcome, store.resolve(), "is empty")
    assert store.stat().st_size == 0  # nothing was written over it


def test_a_missing_ledger_stops_serve_naming_the_file(
    tmp_path: Path, state_dir: Path, model_root: Path
) -> None:
    store = ledger_path(state_dir)
    cut_to_zero_bytes(store)
    store.unlink()
    outcome = start_serve(tmp_path, state_dir, model_root)
    assert_stopped_naming(outcome, store.resolve(), "is missing")
    assert not store.exists()


def test_a_ledger_with_an_overwritten_index_page_stops_serve_naming_the_file(
    tmp_path: Path, state_dir: Path, model_root: Path
) -> None:
    store = ledger_path(state_dir)
    overwrite_an_index_page(store)
    damaged = store.read_bytes()
    outcome = start_serve(tmp_path, state_dir, model_root)
    assert_stopped_naming(outcome, store.resolve(), "fails SQLite's quick_check (Page ")
    assert store.read_bytes() == damaged


def test_a_damaged_ledger_moved_aside_as_told_starts_afresh(
    tmp_path: Path, state_dir: Path, model_root: Path
) -> None:
    store = ledger_path(state_dir)
    overwrite_an_index_page(store)
    assert not start_serve(tmp_path, state_dir, model_root).serving
    aside = tmp_path / "aside"
    aside.mkdir()
    for path in store.parent.glob(f"{LEDGER_FILE}*"):
        path.rename(aside / path.name)
    outcome = start_serve(tmp_path, state_dir, model_root)
    assert outcome.serving, outcome.stderr
    assert (store.parent / f"{LEDGER_FILE}.created").is_file()  # the new ledger is remembered


def test_a_fresh_state_dir_starts(tmp_path: Path, model_root: Path) -> None:
    outcome = start_serve(tmp_path, tmp_path / "state", model_root)
    assert outcome.serving, outcome.stderr


def trained_grpc_runs(state_dir: Path, model_root: Path, configs: dict[str, Any]) -> None:
    """Runs a gRPC client trained one step each and checkpointed, left open on a stopped
    server."""
    with running_server(state_dir, model_root, max_runs=len(configs)) as server:
        for run_id, config in configs.items():
            with connect(server) as client:
                client.open(run_id, config)
                client.forward_backward(TEXTS, operation_key=f"{run_id}/fb")
                client.optim_step(operation_key=f"{run_id}/step")
                client.save_state("one", operation_key=f"{run_id}/save")
                client.close_channel()


def test_a_one_run_servers_ledger_cut_to_zero_bytes_stops_serve_naming_the_file(
    tmp_path: Path, model_root: Path, llama_config: Any
) -> None:
    state_dir = tmp_path / "state"
    trained_grpc_runs(state_dir, model_root, {"run": llama_config()})
    ledger = ledger_path(state_dir)
    cut_to_zero_bytes(ledger)
    outcome = start_serve(tmp_path, state_dir, model_root, tinker=False)
    assert_stopped_naming(outcome, ledger.resolve(), "is empty")
    assert ledger.stat().st_size == 0


def test_a_many_run_servers_ledger_cut_to_zero_bytes_stops_serve_rather_than_fail_one_run(
    tmp_path: Path, model_root: Path, llama_config: Any
) -> None:
    """Every run's journal is in the one ledger: no run could be restored knowing its keys, so
    the server stops at start, naming the file, instead of serving runs that would apply a
    re-sent key a second time."""
    state_dir = tmp_path / "state"
    lora = LoraSettings(r=4, alpha=8)
    configs = {"a": llama_config(lora=lora, seed=1), "b": llama_config(lora=lora, seed=2)}
    trained_grpc_runs(state_dir, model_root, configs)
    ledger = ledger_path(state_dir)
    cut_to_zero_bytes(ledger)
    outcome = start_serve(tmp_path, state_dir, model_root, tinker=False, max_runs=2)
    assert_stopped_naming(outcome, ledger.resolve(), "is empty")
    assert ledger.stat().st_size == 0
