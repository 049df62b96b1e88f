"""``serve(max_runs=N)``: LoRA runs of one base model open side by side over gRPC, each with its own
adapter, optimizer, RNG, position and keys. A run's every result and its final digest are the same
bits alone and interleaved with the others (other seeds, other losses, sampling in between); a
restart restores every open run; what cannot train beside the others is refused by name."""

from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import pytest
from process_cluster import wait_until
from service_fixtures import TEXTS, connect, microbatches, running_server

from trainwire.client import LoraSettings, SessionClient, SessionError, TokenExample
from trainwire.contract.outcomes import OperationSpec
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import ForwardBackwardRequest

BATCHES = microbatches(TEXTS)
TOKENS = [
    TokenExample.from_sequence([5, 9, 14, 3, 7, 21], advantages=[0.5] * 5, logprobs=[-2.0] * 5)
]


def run_steps(client: SessionClient, name: str, steps: range) -> list[Any]:
    """Steps ``steps`` of run ``name``: a text or token batch (by the run), an update, and a
    sample between; every result, as plain values."""
    results: list[Any] = []
    for step in steps:
        if name == "rl":
            outcome = client.forward_backward(
                TOKENS, operation_key=f"{name}/{step}/fb", loss_fn="importance_sampling"
            )
            results.append((outcome.loss, outcome.logprobs))
            samples = client.sample([5, 9, 14], max_tokens=3, num_samples=2, seed=step)
            results.append([(s.tokens, s.logprobs) for s in samples])
        else:
            batch = BATCHES[step % len(BATCHES)]
            results.append(client.forward_backward(batch, operation_key=f"{name}/{step}/fb").loss)
        update = client.optim_step(operation_key=f"{name}/{step}/step")
        results.append((update.step, update.learning_rate, update.grad_norm))
    return results


def configs(llama_config: Any) -> dict[str, Any]:
    lora = LoraSettings(r=4, alpha=8)
    return {
        "sft": llama_config(lora=lora, seed=1, lr_scheduler="constant"),
        "rl": llama_config(lora=lora, seed=2, lr_scheduler="constant", learning_rate=1e-3),
        "sft-2": llama_config(lora=LoraSettings(r=8, alpha=16), seed=3, lr_scheduler="constant"),
    }


def test_runs_side_by_side_give_the_bits_they_give_alone_and_survive_a_restart(
    tmp_path, model_root, llama_config
):
    runs = configs(llama_config)
    alone: dict[str, tuple[list[Any], str]] = {}
    with running_server(tmp_path / "alone", model_root) as server, connect(server) as client:
        for name, config in runs.items():
            client.open(name, config)
            alone[name] = (run_steps(client, name, range(4)), client.info().state_digest)
            client.close()

    state_dir = tmp_path / "shared"
    side_by_side: dict[str, list[Any]] = {name: [] for name in runs}
    with running_server(state_dir, model_root, max_runs=3) as server:
        clients = {name: connect(server) for name in runs}
        for name, config in runs.items():
            clients[name].open(name, config)
        for step in range(2):  # interleaved, one step of each in turn
            for name in runs:
                side_by_side[name] += run_steps(clients[name], name, range(step, step + 1))
        assert [info.run_id for info in clients["sft"].runs()] == sorted(runs)
        for name, client in clients.items():
            client.save_state("mid", operation_key=f"{name}/save")  # what a restart restores
            client.close_channel()
    with running_server(state_dir, model_root, max_runs=3) as server:  # every run restored
        clients = {name: connect(server) for name in runs}
        for name, config in runs.items():
            clients[name].open(name, config)  # reattaches
            assert clients[name].info().position == 5
            side_by_side[name] += run_steps(clients[name], name, range(2, 4))
        for name in runs:
            assert side_by_side[name] == alone[name][0], name
            assert clients[name].info().state_digest == alone[name][1], name
        for client in clients.values():
            client.close_channel()


def test_what_cannot_train_beside_the_open_runs_is_refused_by_name(
    tmp_path, model_root, llama_config, tiny_llama_classifier
):
    lora = LoraSettings(r=4, alpha=8)
    with (
        running_server(tmp_path / "state", model_root, max_runs=2) as server,
        connect(server) as first,
        connect(server) as other,
    ):
        first.open("a", llama_config(lora=lora))
        refusals = {
            "full weights": (
                llama_config(),
                grpc.StatusCode.FAILED_PRECONDITION,
                "trains alone",
            ),
            "another base": (
                llama_config(lora=lora, model=str(tiny_llama_classifier)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "is not this base's model",
            ),
        }
        for what, (config, code, reason) in refusals.items():
            with pytest.raises(SessionError) as refused:
                other.open(f"refused-{what.replace(' ', '-')}", config)
            assert refused.value.code() == code and reason in str(refused.value), what
        other.open("b", llama_config(lora=lora, seed=5))
        with pytest.raises(SessionError) as full:
            SessionClient(f"127.0.0.1:{server.port}").open("c", llama_config(lora=lora))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 runs at once (--max-runs)" in str(full.value)
        with connect(server) as unbound, pytest.raises(SessionError) as unnamed:
            unbound.forward_backward(BATCHES[0], operation_key="u/0")
        assert unnamed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "name the run" in str(unnamed.value)
        assert [r.position for r in first.runs()] == [0, 0]  # nothing ran anywhere
        first.close()  # its own run only: "b" stays, and a full-weights run still waits
        assert [r.run_id for r in other.runs()] == ["b"]
        other.close()
        first.open("full", llama_config())  # alone now
        with pytest.raises(SessionError) as beside_full:
            other.open("d", llama_config(lora=lora))
        assert beside_full.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "run 'full' trains the full weights" in str(beside_full.value)


@pytest.mark.parametrize("weight", [1.0, 2.0])
def test_a_run_that_floods_the_host_delays_another_runs_operation_by_its_weight(
    make_host, llama_config, weight
):
    """Run "flood" (its tenant's weight 1 or 2) has 20 operations waiting; run "other"'s one
    operation, sent after them, runs after at most ``weight`` of them (counted in journal
    entries, never in seconds)."""
    host = make_host(max_runs=2)
    host.run_weight = lambda run_id: weight if run_id == "flood" else 1.0
    lora = LoraSettings(r=4, alpha=8)
    host.open("flood", llama_config(lora=lora, lr_scheduler="constant"))
    host.open("other", llama_config(lora=lora, seed=7, lr_scheduler="constant"))
    gate, running = threading.Event(), threading.Event()

    def hold() -> None:  # the executor's thread is busy until everything below is queued
        running.set()
        gate.wait(60)

    threading.Thread(target=host.scheduler.run, args=(hold,), kwargs={"lane": "hold"}).start()
    running.wait(60)

    def forward_backward(run_id: str, key: str) -> None:
        request = ForwardBackwardRequest(BATCHES[0])
        host.apply(ops.FORWARD_BACKWARD, request, OperationSpec(key), run_id=run_id)

    flood = [threading.Thread(target=forward_backward, args=("flood", f"f/{i}")) for i in range(20)]
    for thread in flood:
        thread.start()
    assert wait_until(lambda: host.scheduler.queued == 21)  # the hold and the flood queued
    other = threading.Thread(target=forward_backward, args=("other", "o/0"))
    other.start()
    assert wait_until(lambda: host.scheduler.queued == 22)
    gate.set()
    other.join(60)
    applied_before = host.info("flood").position  # as the other run's operation returned
    for thread in flood:
        thread.join(60)
    assert host.info("other").position == 1 and host.info("flood").position == 20
    # ``weight`` ran before it (its turn), one more may run while its commit completes.
    assert applied_before <= weight + 1, applied_before


def test_a_run_a_restart_cannot_restore_fails_alone_while_the_others_serve(
    tmp_path, model_root, llama_config
):
    runs = configs(llama_config)
    state_dir = tmp_path / "state"
    with running_server(state_dir, model_root, max_runs=3) as server:
        clients = {name: connect(server) for name in ("sft", "rl")}
        for name, client in clients.items():
            client.open(name, runs[name])
            run_steps(client, name, range(1))
            client.save_state("mid", operation_key=f"{name}/save")
            client.close_channel()
    # The model rl trains is gone from the model root: its restore cannot build its session.
    spec_file = state_dir / "runs" / "rl" / "run.json"
    spec = json.loads(spec_file.read_text())
    spec["config"]["model"] = "removed-model"
    spec_file.write_text(json.dumps(spec))
    with (
        running_server(state_dir, model_root, max_runs=2) as server,
        connect(server) as sft,
        connect(server) as rl,
    ):
        sft.open("sft", runs["sft"])  # restored: it serves
        assert sft.info().position == 3
        run_steps(sft, "sft", range(1, 2))
        assert [(r.run_id, r.state) for r in sft.runs()] == [("rl", "failed"), ("sft", "open")]
        rl.run_id = "rl"
        for call in (
            lambda: rl.forward_backward(TOKENS, operation_key="rl/9/fb"),
            lambda: rl.open("rl", runs["rl"]),
        ):
            with pytest.raises(SessionError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "restoring run 'rl' failed" in str(refused.value)
        with pytest.raises(SessionError) as full:  # it holds its slot until closed
            SessionClient(f"127.0.0.1:{server.port}").open("x", runs["sft-2"])
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert rl.close().state == "closed"
        assert [r.run_id for r in sft.runs()] == ["sft"]


def test_a_refused_first_run_leaves_no_base_behind(make_host, llama_config, model_root):
    """The first LoRA run of a server of many is refused after its base loaded: the next run,
    of another base, loads its own instead of being told the refused run's is the server's."""
    from trainwire.testing import make_tiny_model

    other = make_tiny_model(model_root / "other-llama", seed=4)
    host = make_host(max_runs=2)
    lora = LoraSettings(r=4, alpha=8)
    with pytest.raises(InvalidArgument, match="max_length"):
        host.open("refused", llama_config(lora=lora, model=str(other), max_length=10**6))
    host.open("a", llama_config(lora=lora))
    assert host.open_run_ids == ["a"]
