"""Many models on one server through the real Tinker SDK (``serve(max_runs=N)``): each
``create_lora_training_client`` is a run of its own on the one base model. A run's every result
(samples, their logprobs, the trainer's logprobs, losses, updates) and its final state digest are
the same bits alone on a server and beside three other runs (other seeds, ranks, losses,
learning rates, checkpoints at other steps; one resumed from a checkpoint of its own while the
others train), in process and in a server process SIGKILLed at a
seeded moment and restarted on its state directory (every run restored, every key applied
once)."""

from __future__ import annotations

import contextlib
import random
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tinker
from service_fixtures import connect, wait_for
from test_tinker_restart import GRPC_TOKEN, TinkerServeProcess, logged
from tinker import types
from tinker_loops import KEY, RawFront, close_quietly, service_client, tinker_server

from trainwire.server.service.ledger import ledger_path
from trainwire.server.tinker.model import run_id_for
from trainwire.testing import free_port

# Each run: LoRA rank, seed, loss, learning rate, and the step at which it saves its state. Run
# ``RESUMED`` starts from a checkpoint of a model of its own (one step in), with its optimizer.
RUNS = [
    (4, 0, "cross_entropy", 1e-2, 1),
    (8, 1, "importance_sampling", 5e-3, 2),
    (4, 2, "cross_entropy", 2e-2, 2),
    (8, 3, "importance_sampling", 1e-2, 1),
]
STEPS = 3
RESUMED = 2
SLOTS = len(RUNS) + 1  # the resumed run's first model stays open beside it
PROMPTS = ["the cat", "a dog ran", "birds sing", "the mat"]

Between = Callable[[int], None]


def run_loop(service: tinker.ServiceClient, run: int, between: Between) -> tuple[list, str]:
    """Run ``run``'s RL-or-SL loop as the SDK's docs write it (``between(step)`` runs once a
    step's calls were sent, before their results are awaited); its results and model id."""
    rank, seed, loss, learning_rate, save_at = RUNS[run]
    training = service.create_lora_training_client("llama", rank=rank, seed=seed).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode(PROMPTS[run])
    seen: list[Any] = []
    if run == RESUMED:  # one step, a checkpoint, and the run goes on as a new model from it
        start = datum(prompt, tokenizer.encode(" sat on the mat"), [], "cross_entropy")
        training.forward_backward([start], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
        path = training.save_state("start").result().path
        training = service.create_training_client_from_state_with_optimizer(path).result()
    for step in range(STEPS):
        if step == save_at:
            seen.append(training.save_state(f"step-{step}").result().path.rsplit("/", 2)[-2:])
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=100 * run + step)
        result = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
        data = [
            datum(prompt, list(seq.tokens), list(seq.logprobs), loss) for seq in result.sequences
        ]
        fwd_bwd = training.forward_backward(data, loss)
        optim = training.optim_step(types.AdamParams(learning_rate=learning_rate))
        between(step)
        output = fwd_bwd.result()
        seen.append([(list(seq.tokens), list(seq.logprobs)) for seq in result.sequences])
        seen.append([out["logprobs"].tolist() for out in output.loss_fn_outputs])
        seen.append(output.metrics)
        seen.append(optim.result().metrics)
    return seen, training.model_id


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], loss: str) -> types.Datum:
    """A sample as training data: cross-entropy on its tokens, or importance sampling with an
    advantage of +1 for each even token and -1 for each odd one."""
    full, skipped = prompt + tokens, len(prompt) - 1
    if loss == "cross_entropy":
        inputs: dict[str, Any] = {"weights": [0.0] * skipped + [1.0] * len(tokens)}
    else:
        advantages = [1.0 if token % 2 == 0 else -1.0 for token in tokens]
        inputs = {
            "logprobs": [0.0] * skipped + logprobs,
            "advantages": [0.0] * skipped + advantages,
        }
    inputs["target_tokens"] = full[1:]
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def digests(grpc_port: int, model_ids: list[str], token: str | None = None) -> list[str]:
    """The state digest of each model's run, as the gRPC side lists the open runs (once the
    server is idle: while anything runs, a run's listing gives its digest only if known)."""
    runs = [run_id_for(model_id) for model_id in model_ids]
    with connect(grpc_port, token=token) as client:
        listed: dict[str, str] = {}

        def known() -> bool:
            listed.update({info.run_id: info.state_digest for info in client.runs()})
            return all(listed.get(run) for run in runs)

        wait_for(known, 60)
    return [listed[run] for run in runs]


def side_by_side(base_url: str, between: Callable[[int, int], None]) -> tuple[list, list, list]:
    """Every run's loop on its own ServiceClient and thread, all at once; their results, model
    ids and (open) service clients."""
    services = [tinker.ServiceClient(base_url=base_url, api_key=KEY) for _ in RUNS]
    results: list[Any] = [None] * len(RUNS)
    errors: list[BaseException] = []

    def one(run: int) -> None:
        try:
            results[run] = run_loop(services[run], run, lambda step: between(run, step))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=one, args=(run,)) for run in range(len(RUNS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    return [r[0] for r in results], [r[1] for r in results], services


@pytest.fixture(scope="module")
def alone(
    tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path
) -> tuple[list, list]:
    """Each run alone, one after the other: results and digests."""
    seen, final = [], []
    # Two slots: the resumed run's first model stays open beside it (no other run trains).
    with tinker_server(tmp_path_factory.mktemp("alone"), model_root, max_runs=2) as handle:
        for run in range(len(RUNS)):
            service = service_client(handle)
            results, model_id = run_loop(service, run, lambda step: None)
            seen.append(results)
            final.extend(digests(handle.port, [model_id], KEY))
            close_quietly(service)  # its model closes: the next one takes the server
    return seen, final


@pytest.mark.slow
def test_four_sdk_runs_side_by_side_give_the_bits_each_gives_alone(
    tmp_path: Path, model_root: Path, alone: tuple[list, list]
) -> None:
    with tinker_server(tmp_path / "state", model_root, max_runs=SLOTS) as handle:
        seen, model_ids, services = side_by_side(handle.tinker.base_url, lambda run, step: None)
        try:
            assert len(set(model_ids)) == len(RUNS)
            assert seen == alone[0]
            assert digests(handle.port, model_ids, KEY) == alone[1]
        finally:
            for service in services:
                close_quietly(service)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 11])
def test_four_sdk_runs_through_a_sigkill_end_as_each_alone(
    tmp_path: Path, model_root: Path, alone: tuple[list, list], seed: int
) -> None:
    """The server process is SIGKILLed at a seeded moment (a run and step, once that step's
    optim_step of that run is accepted, or at once) while the four runs train pipelined, and
    restarted on the same port: every run ends with its results and digest alone."""
    chooser = random.Random(seed)
    kill_run, kill_step, wait = (
        chooser.randrange(len(RUNS)),
        chooser.randrange(STEPS),
        chooser.random() < 0.5,
    )
    port, state_dir = free_port(), tmp_path / "state"
    options = ("--max-runs", str(SLOTS))
    started = [TinkerServeProcess(tmp_path, state_dir, model_root, port, "first", options=options)]
    killed = threading.Event()

    def between(run: int, step: int) -> None:
        if run != kill_run or step != kill_step or killed.is_set():
            return
        killed.set()
        if wait:
            # The run's calls so far: a create is none, each step a sampler, fwd_bwd and optim.
            calls = 3 * (step + 1) + (1 if step >= RUNS[run][4] else 0)
            wait_for(logged(state_dir, "optim_step", calls), 60)  # (any model's of that seq_id)
        started[-1].kill()
        started.append(
            TinkerServeProcess(tmp_path, state_dir, model_root, port, "second", options=options)
        )

    try:
        seen, model_ids, services = side_by_side(f"http://127.0.0.1:{port}", between)
        assert killed.is_set() and len(started) == 2
        assert "request records read back" in started[-1].log.read_text()
        assert seen == alone[0]
        assert digests(started[-1].grpc_port, model_ids, GRPC_TOKEN) == alone[1]
        for service in services:
            close_quietly(service)
    finally:
        for process in started:
            process.kill()


@pytest.mark.slow
def test_a_model_that_floods_the_server_delays_another_models_call_by_one_of_its_own(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Fair share through the SDK's routes: model "flood" has 200 ``forward_backward`` calls
    released, then model "other" one; "other"'s runs after at most one of the flood's (counted
    in journal entries, in the order the executor applied them). Before the order took turns
    by run, it ran after all 200."""
    calls = 200
    with tinker_server(tmp_path / "state", model_root, max_runs=2) as handle:
        front = RawFront(handle.tinker.base_url)
        models = []
        for _ in range(2):
            session_id = front.post("create_session", {}).json()["session_id"]
            body = {"session_id": session_id, "base_model": "llama", "lora_config": {"rank": 4}}
            models.append(front.post("create_model", body).json()["model_id"])
        flood, other = models
        order, release, holding = (
            handle.tinker.front.intake.scheduler,
            threading.Event(),
            threading.Event(),
        )
        order.start_stream("test-hold", 1)  # hold the order while every call is released
        order.submit("test-hold", 1, "hold", lambda: (holding.set(), release.wait(120)))
        assert holding.wait(30)
        flooded = [
            front.forward_backward(flood, seq).json()["request_id"] for seq in range(1, calls + 1)
        ]
        last = front.forward_backward(other, 1).json()["request_id"]
        release.set()
        front.poll(last, timeout_s=120)
        for request_id in flooded:
            front.poll(request_id, timeout_s=120)
        applied = {model: recorded(handle, model) for model in models}
    (other_at,) = applied[other]
    before = [at for at in applied[flood] if at < other_at]
    assert len(applied[flood]) == calls and len(before) <= 1


def recorded(handle: Any, model_id: str) -> list[float]:
    """When each of ``model_id``'s run's journal entries was recorded (the executor's order)."""
    ledger = ledger_path(handle.session_host.state_dir.root)
    with contextlib.closing(sqlite3.connect(ledger)) as db:
        rows = db.execute(
            "SELECT recorded_at FROM operations WHERE run = ?", (run_id_for(model_id),)
        )
        return [at for (at,) in rows]
