"""Samples of several LoRA runs decoded together by the service: the scheduler takes the sample
at the head of each other run's lane into the batch whose turn it is (each spending its run's
turn) where ``sample_batching.together_problem`` allows it, and every sample is the bits its
run gives it alone. The scheduler counts those decodes, so the test tells samples decoded
together from samples taking turns."""

from __future__ import annotations

import dataclasses
import pickle
import threading
from typing import Any

from host_operations import BATCHES, op
from process_cluster import wait_until
from test_fair_turns import held
from test_samples_together import ADAPTERS, requests_of

from trainwire.server.service import operations as ops
from trainwire.server.service import reads
from trainwire.server.service.requests import ForwardBackwardRequest, OptimStepRequest

RUNS = ("a", "b", "c")


def trained_host(make_host: Any, llama_config: Any) -> Any:
    """A host of three LoRA runs on one base, each adapter trained a step on its own texts."""
    host = make_host(max_runs=len(RUNS))
    for index, name in enumerate(RUNS):
        lora, seed = ADAPTERS[name]
        host.open(name, llama_config(lora=lora, seed=seed, lr_scheduler="constant"))
        request = ForwardBackwardRequest(BATCHES[index])
        host.apply(ops.FORWARD_BACKWARD, request, op(f"{name}0", 0), run_id=name)
        host.apply(ops.OPTIM_STEP, OptimStepRequest(), op(f"{name}1", 1), run_id=name)
    return host


def sample_at_once(host: Any, requests: dict[str, Any]) -> tuple[dict[str, bytes], int]:
    """Each run's request sent by its own caller while the engine is held, released once every
    run's sample waits at its lane's head; the pickled answers and the decodes together."""
    scheduler = host.scheduler
    before = scheduler.samples_together
    gate = held(scheduler)
    answers: dict[str, bytes] = {}

    def ask(name: str) -> None:
        answer = host.apply(ops.SAMPLE, requests[name], run_id=name)
        answers[name] = pickle.dumps(answer)

    callers = [threading.Thread(target=ask, args=(name,)) for name in requests]
    for caller in callers:
        caller.start()

    def all_waiting() -> bool:
        return sorted(scheduler.ready_lanes(lambda job: job.is_sample)) == sorted(requests)

    assert wait_until(all_waiting, 60)
    gate.set()
    for caller in callers:
        caller.join(60)
    return answers, scheduler.samples_together - before


def test_several_runs_samples_decode_as_one_batch_each_the_bits_alone(make_host, llama_config):
    host = trained_host(make_host, llama_config)
    vocab = host._runs["a"].session.sampler.vocab_size
    requests = {name: requests_of(run, vocab)[0] for run, name in enumerate(RUNS)}
    answers, together = sample_at_once(host, requests)
    assert together == 1
    for name, request in requests.items():
        alone = reads.sample(host._runs[name], request, None)
        assert answers[name] == pickle.dumps(alone)


def test_a_sample_of_other_weights_takes_its_own_turn_and_equals_alone(make_host, llama_config):
    host = trained_host(make_host, llama_config)
    vocab = host._runs["a"].session.sampler.vocab_size
    requests = {name: requests_of(run, vocab)[0] for run, name in enumerate(RUNS)}
    requests["c"] = dataclasses.replace(requests["c"], base_model=True)  # not its live weights
    answers, together = sample_at_once(host, requests)
    assert together == 1  # a and b together, c in its own turn
    for name, request in requests.items():
        alone = reads.sample(host._runs[name], request, None)
        assert answers[name] == pickle.dumps(alone)
