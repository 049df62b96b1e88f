"""The SDK's sampling options against a real server, through the real SDK: ``topk_sample_logprobs``,
``topk_prompt_logprobs``, ``prompt_logprobs_last_n`` and ``target_prompt_logprobs``.

Every number the SDK reads is the one the trainer's ``forward`` gives for that id as the target at
that position, bit for bit; the shapes are the SDK's own (a CSR request gets a CSR answer); a bad
option is a 400 that is never logged; futures asking for different options decode as one batch,
each as alone; and a sample with options logged before a restart is answered with the same
bytes."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from ledger_files import opened_store
from sample_requests import held_executor, spy_batches
from service_fixtures import wait_for
from test_bounds_tinker import HEADERS, Front, start
from test_sample_logprob_options import check_top_rows
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response
from tinker_loops import SdkRun, lora_training, tinker_server, train_step

from trainwire.server.service import operations as ops
from trainwire.server.service.request_records import SampleRecord
from trainwire.server.service.requests import TokenizeRequest

K = 3
GREEDY = types.SamplingParams(max_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path):
    """A LoRA run one update past its base, and a sampling client of those weights."""
    with lora_training(tmp_path_factory.mktemp("options") / "state", model_root) as started:
        train_step(started, "the cat sat on the mat")
        sampler = started.training.save_weights_and_get_sampling_client().result(timeout=60)
        yield started, sampler


def forward(run: SdkRun, tokens: Sequence[int], targets: Sequence[int]) -> list[float]:
    """The trainer's logprobs of ``targets`` after the prefixes of ``tokens``, one datum alone."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)),
        loss_fn_inputs={"target_tokens": list(targets), "weights": [1.0] * len(targets)},
    )
    output = run.training.forward([datum], "cross_entropy").result(timeout=60)
    return output.loss_fn_outputs[0]["logprobs"].tolist()


def test_top_k_last_n_and_target_logprobs_are_the_trainers_forward_bit_for_bit(run) -> None:
    training, sampler = run
    prompt = training.tokenizer.encode("the cat sat on the mat and")
    length, last_n = len(prompt), 3
    targets = np.full((length - 1, 2), -1, dtype=np.int64)
    targets[2:, 0] = [(11 * i) % 500 for i in range(length - 3)]
    targets[-1, 1] = 42
    response = sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        GREEDY,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=K,
        topk_sample_logprobs=K,
        target_prompt_logprobs=types.TensorData.from_numpy(targets),
        prompt_logprobs_last_n=last_n,
    ).result(timeout=60)

    (sequence,) = response.sequences
    full = [*prompt, *sequence.tokens]
    assert len(sequence.topk_logprobs) == len(sequence.tokens)
    trainer = functools.partial(forward, training)
    check_top_rows(trainer, full[:-1], full[1:], sequence.topk_logprobs, length - 1)
    # greedy: the best id is the token drawn, valued as the sample's own logprob
    assert [row[0] for row in sequence.topk_logprobs] == list(
        zip(sequence.tokens, sequence.logprobs, strict=True)
    )

    plain = forward(training, prompt[:-1], prompt[1:])
    first = length - last_n
    assert response.prompt_logprobs == [None] * first + plain[first - 1 :]
    assert response.topk_prompt_logprobs[:first] == [None] * first
    check_top_rows(
        trainer, prompt[:-1], prompt[1:], response.topk_prompt_logprobs[first:], first - 1
    )

    answered = response.target_prompt_logprobs
    assert answered.shape == [length - 1, 2] and answered.sparse_crow_indices is None
    values = answered.to_numpy()
    for column in range(2):
        named = [
            int(t) if t >= 0 else p for t, p in zip(targets[:, column], prompt[1:], strict=True)
        ]
        scored = forward(training, prompt[:-1], named)
        expected = [s if t >= 0 else 0.0 for s, t in zip(scored, targets[:, column], strict=True)]
        assert values[:, column].tolist() == expected


def test_a_sparse_target_request_gets_a_sparse_answer_of_its_cells(run) -> None:
    training, sampler = run
    prompt = training.tokenizer.encode("a dog ran in the park and the birds sang")
    ids = torch.full((len(prompt) - 1, 4), -1, dtype=torch.int64)
    ids[3, 1], ids[7, 0], ids[7, 3] = 5, 9, 400
    request = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert request.sparse_crow_indices is not None
    response = sampler.sample(
        types.ModelInput.from_ints(prompt), 1, GREEDY, target_prompt_logprobs=request
    ).result(timeout=60)
    answered = response.target_prompt_logprobs
    assert answered.sparse_crow_indices == request.sparse_crow_indices
    assert answered.sparse_col_indices == request.sparse_col_indices
    assert response.prompt_logprobs is None and response.topk_prompt_logprobs is None
    dense = answered.to_numpy()
    assert np.count_nonzero(dense) == 3
    for position, token in ((3, 5), (7, 9), (7, 400)):
        targets = list(prompt[1:])
        targets[position] = token
        assert (
            dense[position][list(ids[position]).index(token)]
            == (forward(training, prompt[:-1], targets)[position])
        )


def test_futures_asking_other_logprobs_decode_as_one_batch_each_as_alone(run, monkeypatch):
    training, sampler = run
    host = training.handle.session_host
    prompt = types.ModelInput.from_ints(training.tokenizer.encode("birds sing in the"))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=8)
    options: list[dict[str, Any]] = [
        {},
        {"topk_sample_logprobs": 2},
        {"include_prompt_logprobs": True, "topk_prompt_logprobs": 4, "prompt_logprobs_last_n": 2},
        {"topk_sample_logprobs": 1, "topk_prompt_logprobs": 1},
    ]

    def send(option: dict[str, Any]):
        return sampler.sample(prompt, 2, params, **option)

    def seen(response) -> tuple:
        sequences = [(s.tokens, s.logprobs, s.topk_logprobs) for s in response.sequences]
        return sequences, str(response.prompt_logprobs), response.topk_prompt_logprobs

    expected = [seen(send(option).result(timeout=60)) for option in options]
    assert len({str(e[0][0][:2]) for e in expected}) == 1  # the same draws, other reports
    sizes = spy_batches(monkeypatch)
    started, release = held_executor(host, monkeypatch)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(host.apply, ops.TOKENIZE, TokenizeRequest(["x"]))
        assert started.wait(30)
        futures = [send(option) for option in options]
        wait_for(lambda: host.scheduler.queued == len(options) + 1)
        release.set()
        held.result(timeout=60)
        assert [seen(f.result(timeout=120)) for f in futures] == expected
    assert sizes == [len(options)]


# -- a bad option: a 400 naming it, never logged -------------------------------------------------


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, model_root: Path, tiny_llama: Path):
    with start(tmp_path_factory.mktemp("refusals") / "state", model_root) as started:
        yield started


def target_tensor(rows: list[list[int]], **layout: Any) -> dict[str, Any]:
    data = [token for row in rows for token in row]
    return {"data": data, "dtype": "int64", "shape": [len(rows), len(rows[0])], **layout}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"topk_sample_logprobs": 21}, "topk_sample_logprobs must be in [0, 20], got 21"),
        ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs must be in [0, 20], got -1"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n applies to prompt logprobs"),
        (
            {"prompt_logprobs": True, "prompt_logprobs_last_n": 3},
            "prompt_logprobs_last_n must be in [1, 2], got 3",
        ),
        ({"target_prompt_logprobs": target_tensor([[4]] * 3)}, "has 3 rows; the prompt's"),
        ({"target_prompt_logprobs": target_tensor([[-1], [-1]])}, "names no id"),
        ({"target_prompt_logprobs": target_tensor([[4] * 21] * 2)}, "at most [32768, 20]"),
        (
            {"target_prompt_logprobs": {**target_tensor([[4], [5]]), "dtype": "float32"}},
            "must be an int64 tensor",
        ),
        (
            {"target_prompt_logprobs": target_tensor([[4], [5]], sparse_crow_indices=[0, 2])},
            "not a CSR layout",
        ),
    ],
)
def test_a_bad_sampling_option_is_a_400_naming_it_and_is_never_logged(
    front: Front, settings: dict[str, Any], message: str
) -> None:
    before = front.log_bytes()
    response = front.sample(2000, **settings)
    assert response.status_code == 400, response.text
    assert message in response.json()["detail"]
    assert front.log_bytes() == before


def test_an_id_outside_the_vocabulary_fails_that_sample_alone(front: Front) -> None:
    """Only the engine knows the vocabulary: the call is taken, and fails as the user's."""
    response = front.sample(2001, target_prompt_logprobs=target_tensor([[4], [500]]))
    failed = front.result(response.json()["request_id"]).json()
    assert failed["category"] == "user" and "ids in [0, 500) or -1" in failed["error"]
    response = front.sample(2002, topk_sample_logprobs=2)
    assert front.result(response.json()["request_id"]).status_code == 200


# -- exactly once: the options are the request's, logged and replayed with it --------------------


def options_body(sampling_session_id: str, seq_id: int) -> dict[str, Any]:
    return {
        "sampling_session_id": sampling_session_id,
        "seq_id": seq_id,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8, 9]}]},
        "sampling_params": {"max_tokens": 4, "seed": 5},
        "prompt_logprobs": True,
        "prompt_logprobs_last_n": 3,
        "topk_prompt_logprobs": 2,
        "topk_sample_logprobs": 3,
        "target_prompt_logprobs": target_tensor([[-1], [4], [-1], [7]]),
    }


def poll(client: httpx.Client, request_id: str) -> httpx.Response:
    while True:
        response = client.post("/retrieve_future", json={"request_id": request_id})
        if not response.headers["content-type"].startswith("application/json"):
            return response
        assert response.json().get("type") == "try_again", response.text


def test_a_sample_with_options_is_answered_after_a_restart_with_the_same_bytes(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """One answered before the restart (its stored result), one logged and never run, as when
    the server dies right after accepting it (run again from its logged body): both the bytes
    the uninterrupted server gave."""
    state_dir = tmp_path / "state"
    with start(state_dir, model_root) as first:
        sampling_id = first.sampling_session_id
        body = options_body(sampling_id, 1)
        answered = poll(first.client, first.client.post("/asample", json=body).json()["request_id"])
    assert answered.status_code == 200
    with opened_store(state_dir) as store:
        store.write(SampleRecord(f"{sampling_id}/2", options_body(sampling_id, 2)))
    with tinker_server(state_dir, model_root) as handle:
        api = f"{handle.tinker.base_url}/api/v1"
        with httpx.Client(base_url=api, headers=HEADERS, timeout=60) as client:
            assert poll(client, f"{sampling_id}/1").content == answered.content
            assert poll(client, f"{sampling_id}/2").content == answered.content
    sdk_reads = deserialize_sample_response(answered.content)  # the options were honoured
    assert [len(s.topk_logprobs[0]) for s in sdk_reads.sequences] == [3, 3]
    assert (
        sdk_reads.prompt_logprobs[:2] == [None, None] and None not in sdk_reads.prompt_logprobs[2:]
    )
    assert sdk_reads.target_prompt_logprobs.to_numpy()[:, 0].tolist()[0::2] == [0.0, 0.0]
