"""Dispatch: many manifests over a pool of servers, each run ending with its reference digest."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from service_fixtures import running_server

from trainwire.cli import main
from trainwire.client import ManagedTrainingPlan, SessionClient, write_manifest
from trainwire.client.control.dispatch import Dispatcher, run_id_for
from trainwire.server.engine.managed import ManagedTraining
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import (
    free_port,
    tiny_sentiment_examples,
    tiny_text_examples,
    wait_for_listener,
)


@pytest.fixture(scope="module")
def plans(bert_classifier_config, llama_config):
    evals = tiny_sentiment_examples(8, seed=1)
    classify = dict(eval_strategy="epoch", metric_for_best="eval_accuracy", learning_rate=5e-3)
    return {
        "sentiment-a": ManagedTrainingPlan(
            tiny_sentiment_examples(24),
            bert_classifier_config(batch_size=4, num_epochs=2, **classify),
            eval_examples=evals,
        ),
        "sentiment-b": ManagedTrainingPlan(
            tiny_sentiment_examples(20, seed=5),
            bert_classifier_config(batch_size=5, gradient_accumulation_steps=2, **classify),
            eval_examples=evals,
        ),
        "text": ManagedTrainingPlan(
            tiny_text_examples(16), llama_config(batch_size=4, num_epochs=2, learning_rate=1e-3)
        ),
    }


@pytest.fixture(scope="module")
def reference_digests(plans):
    digests = {}
    for name, plan in plans.items():
        session = TrainingSession(plan.config, max_steps=plan.max_steps)
        digests[name] = ManagedTraining(session, plan).run().state_digest
    return digests


def write_manifests(plans, directory):
    paths = {}
    for name, plan in plans.items():
        paths[name] = directory / f"{name}.json"
        write_manifest(paths[name], plan.to_manifest())
    return paths


def serve_process(tmp_path, model_root, port, *options):
    """``trainwire serve`` on ``port`` as a process of its own (its state and log in
    ``tmp_path``), with ``options`` added."""
    args = [sys.executable, "-m", "trainwire", "serve", "--listen", f"127.0.0.1:{port}",
            "--state-dir", str(tmp_path / f"state-{port}"), "--model-root", str(model_root),
            "--device", "cpu", *options]  # fmt: skip
    log = open(tmp_path / f"server-{port}-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)


def summary_digest(work_dir, path, plan):
    summary = work_dir / run_id_for(path, plan) / "training_summary.json"
    return json.loads(summary.read_text())["state_digest"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dispatch_over_three_servers_survives_a_killed_server(
    plans, reference_digests, model_root, tmp_path
):
    manifests = write_manifests(plans, tmp_path)
    ports = [free_port() for _ in plans]
    servers = {}

    def start(port):
        servers[port] = serve_process(tmp_path, model_root, port)

    for port in ports:
        start(port)
    for port in ports:  # a server never reached fails its run at once
        wait_for_listener(f"127.0.0.1:{port}")
    dispatcher = Dispatcher(
        [f"127.0.0.1:{port}" for port in ports],
        list(manifests.values()),
        work_dir=tmp_path / "runs",
        client_factory=lambda target: SessionClient(target, timeout_s=60),
        checkpoint_every=1,
    )
    thread = threading.Thread(target=dispatcher.run)
    thread.start()
    try:
        # Kill the first server once its run has made progress, then bring it back.
        victim = ports[0]
        deadline = time.monotonic() + 120
        while not any(
            s.server.endswith(str(victim)) and s.step >= 2 for s in dispatcher.statuses()
        ):
            assert time.monotonic() < deadline, dispatcher.statuses()
            time.sleep(0.02)
        servers[victim].send_signal(signal.SIGKILL)
        servers[victim].wait()
        start(victim)
        thread.join(timeout=400)
        assert not thread.is_alive()
    finally:
        for process in servers.values():
            process.kill()
            process.wait()

    statuses = {status.manifest: status for status in dispatcher.statuses()}
    for name, path in manifests.items():
        status = statuses[str(path)]
        assert status.state == "done", status
        assert status.result.state_digest == reference_digests[name]
        assert summary_digest(tmp_path / "runs", path, plans[name]) == reference_digests[name]


@pytest.mark.slow  # two runs trained through one server: 10-15 s on two busy cores
def test_a_server_takes_the_next_run_after_closing_the_last(
    plans, reference_digests, model_root, tmp_path, capsys
):
    manifests = write_manifests(plans, tmp_path)
    with running_server(tmp_path / "state", model_root) as handle:
        code = main(
            ["dispatch", "--servers", f"127.0.0.1:{handle.port}", "--manifests",
             *map(str, manifests.values()), "--work-dir", str(tmp_path / "runs"), "--quiet"]
        )  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "summary" in table and table.count("done") == len(plans)
    for name, path in manifests.items():
        assert summary_digest(tmp_path / "runs", path, plans[name]) == reference_digests[name]


def test_dispatch_refuses_an_empty_pool_and_a_repeated_manifest(plans, tmp_path):
    manifests = write_manifests(plans, tmp_path)
    path = manifests["text"]
    with pytest.raises(ValueError, match="at least one server"):
        Dispatcher([], [path], work_dir=tmp_path, client_factory=SessionClient)
    with pytest.raises(ValueError, match="listed twice"):
        Dispatcher(["127.0.0.1:1"], [path, path], work_dir=tmp_path, client_factory=SessionClient)


@pytest.mark.slow  # two server processes, three runs
@pytest.mark.timeout(600)
def test_runs_of_one_base_fill_a_server_before_another_takes_that_base(
    llama_config, model_root, tmp_path
):
    """Two servers of two runs each (``serve --max-runs 2``, ``--runs-per-server 2``), three
    LoRA runs of one base: the first two share a server, the third goes to the other once the
    first is full; each ends with the digest it has trained alone. (Server processes: sessions
    of two servers in one process would share torch's global generator.)"""
    from trainwire.client import LoraSettings

    lora = LoraSettings(r=4, alpha=8)
    plans = {
        f"lora-{seed}": ManagedTrainingPlan(
            tiny_text_examples(8, seed=seed),
            llama_config(batch_size=4, learning_rate=1e-3, lora=lora, seed=seed),
        )
        for seed in (1, 2, 3)
    }
    alone = {
        name: ManagedTraining(TrainingSession(plan.config, max_steps=plan.max_steps), plan)
        .run()
        .state_digest
        for name, plan in plans.items()
    }
    manifests = write_manifests(plans, tmp_path)
    ports = [free_port(), free_port()]
    servers = []
    try:
        for port in ports:
            servers.append(serve_process(tmp_path, model_root, port, "--max-runs", "2"))
        for port in ports:
            wait_for_listener(f"127.0.0.1:{port}")
        dispatcher = Dispatcher(
            [f"127.0.0.1:{port}" for port in ports],
            list(manifests.values()),
            work_dir=tmp_path / "runs",
            client_factory=lambda target: SessionClient(target, timeout_s=60),
            runs_per_server=2,
        )
        statuses = {status.manifest: status for status in dispatcher.run()}
    finally:
        for process in servers:
            process.kill()
            process.wait()
    by_name = {name: statuses[str(path)] for name, path in manifests.items()}
    assert all(status.state == "done" for status in by_name.values()), by_name
    assert by_name["lora-1"].server == by_name["lora-2"].server != by_name["lora-3"].server
    for name, path in manifests.items():
        assert summary_digest(tmp_path / "runs", path, plans[name]) == alone[name]
