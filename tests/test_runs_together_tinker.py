"""Runs computed together through the real Tinker SDK: four LoRA models on one server send
their ``forward_backward`` calls at once; the scheduler runs the ready ones as one pass over
the base (the SDK's calls are queued through the same submit as gRPC's, each at its seq_id),
and every model's logprobs, metrics and final state digest are the bits it gets alone on a
server. The models keep the SDK's default LoRA targets, the unembedding (the head) included. The
test counts the shared passes, so it tells runs computed together from turns."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import tinker
from process_cluster import wait_until
from test_fair_turns import held
from test_tinker_many_runs import digests
from tinker import types
from tinker_loops import KEY, close_quietly, service_client, supervised_datum, tinker_server

# Four texts a step, each model the same texts (a sweep over seeds): one padded width a step.
# The longest rows score 14 positions: enough for the head's product to stack them, each
# model's chunks under its own head adapter; the shorter ones run their own head.
TEXTS = [
    [
        "the cat sat on the mat all day",
        "a dog ran in the park at noon",
        "birds sing in the morning",
        "the mat",
    ],
    ["a dog sat on the cat for an hour", "the park ran a dog", "morning birds sing", "in the park"],
]
SEEDS = (1, 2, 3, 4)


def sdk_loop(
    service: tinker.ServiceClient, seed: int, step: threading.Barrier | None
) -> tuple[list[Any], str]:
    """A supervised loop as the SDK's docs write it: each step's forward_backward and
    optim_step sent together, then awaited; what it saw and its model id. ``step``: met
    before each step's calls are sent."""
    # The SDK's defaults: attention, MLP and the unembedding (the head) each carry an adapter.
    training = service.create_lora_training_client("llama", rank=4, seed=seed).result()
    tokenizer = training.get_tokenizer()
    seen: list[Any] = []
    for texts in TEXTS:
        data = [supervised_datum(tokenizer, text) for text in texts]
        if step is not None:
            step.wait(timeout=60)
        fwd_bwd = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
        output = fwd_bwd.result(timeout=120)
        seen.append([out["logprobs"].tolist() for out in output.loss_fn_outputs])
        seen.append(output.metrics)
        seen.append(optim.result(timeout=120).metrics)
    return seen, training.model_id


def test_sdk_models_share_passes_and_each_ends_as_alone(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """``tiny_llama``: the base, ``llama`` under ``model_root``."""
    alone_seen, alone_digests = [], []
    with tinker_server(tmp_path / "alone", model_root, max_runs=2) as handle:
        for seed in SEEDS:
            service = service_client(handle)
            seen, model_id = sdk_loop(service, seed, None)
            alone_seen.append(seen)
            alone_digests.extend(digests(handle.port, [model_id], KEY))
            close_quietly(service)  # its model closes: the next one has the server alone
        assert handle.session_host.scheduler.shared_passes == 0  # one run at a time

    with tinker_server(tmp_path / "together", model_root, max_runs=len(SEEDS)) as handle:
        scheduler = handle.session_host.scheduler
        gates: list[threading.Event] = []

        def hold_the_engine() -> None:
            gates.append(held(scheduler))  # until every model's forward_backward is ready

        # Met by every model's loop before a step: the engine is then held, the calls sent.
        step = threading.Barrier(len(SEEDS), action=hold_the_engine)
        services = [service_client(handle) for _ in SEEDS]
        results: list[Any] = [None] * len(SEEDS)

        def loop(index: int) -> None:
            results[index] = sdk_loop(services[index], SEEDS[index], step)

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(SEEDS))]
        for thread in threads:
            thread.start()
        for count in range(1, len(TEXTS) + 1):
            assert wait_until(lambda count=count: len(gates) == count, 120)
            assert wait_until(
                lambda: (
                    len(scheduler.ready_lanes(lambda job: job.shared is not None)) == len(SEEDS)
                ),
                60,
            )
            gates[-1].set()
        for thread in threads:
            thread.join(timeout=60)
        assert all(result is not None for result in results), "a model's loop did not end"
        # Each step: one pass of the four models' forward_backward calls.
        assert (scheduler.shared_passes, scheduler.shared_jobs) == (len(TEXTS), 4 * len(TEXTS))
        model_ids = [model_id for _, model_id in results]
        assert [seen for seen, _ in results] == alone_seen
        assert digests(handle.port, model_ids, KEY) == alone_digests
        for service in services:
            close_quietly(service)
