"""Sampling and prompt logprobs on a sharded session: two CPU ranks over gloo decode on the FSDP
model with rank 0's draws, and answer what one process answers.

``sampling_calls`` is what each side runs: for full weights and LoRA, a session trains a step,
exports, trains another, then samples its live weights (twice, greedy, with a stop token and a
stop string), scores its prompt, samples the export and the base model, and is refused a
missing export; then it trains on. A fresh session samples and loads the export, and a control
session trains the same steps without sampling. The two ranks run it as the ``sampling`` scenario
(``sharded_workers``). The reference is one process sampling the same weights (the base model,
the ranks' export) on one thread, as each rank runs (a CPU matmul's bits depend on its thread
count): equal bit for bit.

Served: a real ``trainwire serve --nproc 2`` with the Tinker front answers an SDK sampling client
and a gRPC ``Sample``, each request announced to both ranks: its fresh model samples the bits one
process samples with the run's configuration, and the group trains on afterwards.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import sharded_runs as runs
import sharded_workers as workers
import tinker
import torch
import torch.distributed as dist
from tinker import types
from tinker_loops import KEY, close_quietly, rl_step, supervised_datum

from trainwire.client import SessionClient, TokenExample, TrainingConfig
from trainwire.contract.outcomes import Sample
from trainwire.server.engine.sampling.sample_weights import BASE_MODEL
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import free_port, tiny_token_examples

OPTIONS = {"max_tokens": 8, "num_samples": 3, "temperature": 1.0, "seed": 7}
MODES = {"full": False, "lora": True}  # LoRA without dropout: sampling runs in eval mode anyway


# -- the calls, on two ranks and in one process --------------------------------------------------


def sampling_calls(spec: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every mode's calls (see the module docstring); what each gave, as JSON holds it."""
    out = Path(spec["out"])
    return {mode: _calls_of(spec["model"], group, lora, out / mode) for mode, lora in MODES.items()}


def _open(model: str, group: dist.ProcessGroup | None, lora: bool) -> TrainingSession:
    config = workers.make_config(model, lora)
    return TrainingSession(config, max_steps=workers.MAX_STEPS, process_group=group)


def _train_a_step(session: TrainingSession, seed: int) -> None:
    examples = tiny_token_examples(4, vocab_size=len(session.tokenizer), seed=seed)
    session.forward_backward(examples)
    session.optim_step(learning_rate=5e-2)  # large enough that every step moves the samples


def _sampled(samples: list[Sample]) -> list[Any]:
    return [[list(s.tokens), list(s.logprobs), s.stop_reason] for s in samples]


def _calls_of(model: str, group: dist.ProcessGroup | None, lora: bool, out: Path) -> dict[str, Any]:
    session = _open(model, group, lora)
    prompt = session.tokenize(["the movie was"])[0]
    _train_a_step(session, seed=0)
    session.export_weights(out / "export")
    _train_a_step(session, seed=1)  # the live weights move past the export
    digest = session.state_digest()
    seen: dict[str, Any] = {"live": _sampled(session.sample(prompt, **OPTIONS))}
    seen["again"] = _sampled(session.sample(prompt, **OPTIONS))
    seen["forward"] = [
        session.forward([TokenExample(full[:-1], full[1:])]).logprobs[0][len(prompt) - 1 :]
        for full in ([*prompt, *tokens] for tokens, _, _ in seen["live"])
    ]
    seen.update(_stops(session, prompt))
    scored = session.prompt_logprobs(prompt)
    seen["prompt_nan"], seen["prompt"] = math.isnan(scored[0]), scored[1:]
    seen["export"] = _sampled(session.sample(prompt, weights=out / "export", **OPTIONS))
    seen["export_prompt"] = session.prompt_logprobs(prompt, weights=out / "export")[1:]
    seen["base"] = _sampled(session.sample(prompt, weights=BASE_MODEL, **OPTIONS))
    seen["missing"] = runs.raised(
        lambda: session.sample(prompt, weights=out / "removed", **OPTIONS)
    )
    session.drop_digest_cache()
    seen["digest_unchanged"] = session.state_digest() == digest and session.broken is None
    _train_a_step(session, seed=2)  # training goes on after sampling, as if none had run

    fresh = _open(model, group, lora)
    seen["fresh"] = _sampled(fresh.sample(prompt, **OPTIONS))
    seen["alone"] = _decoded_alone(fresh, prompt, group)
    fresh.load_weights(out / "export")
    seen["loaded"] = _sampled(fresh.sample(prompt, **OPTIONS))
    control = _open(model, group, lora)
    for seed in range(3):
        _train_a_step(control, seed)
    seen["trains_on_as_without_sampling"] = session.state_digest() == control.state_digest()
    return seen


def _decoded_alone(
    session: TrainingSession, prompt: list[int], group: dist.ProcessGroup | None
) -> list[Any]:
    """Samples decoded alone (``Sampler.batches`` False), set on rank 0 only, as a served group's
    host sets it: rank 0's mode is the group's. Nine rows: alone, one forward a step; batched,
    two tiles of 8 (a follower that kept its own mode would run other forwards and hang)."""
    session.sampler.batches = group is not None and dist.get_rank(group) != 0
    alone = _sampled(session.sample(prompt, max_tokens=3, num_samples=9, seed=5))
    session.sampler.batches = True  # every rank back to the default
    return alone


def _stops(session: TrainingSession, prompt: list[int]) -> dict[str, Any]:
    """Greedy samples, and greedy ended by its third token (a stop token) or by the text of its
    first two (a stop string)."""
    greedy = _sampled(session.sample(prompt, max_tokens=8, num_samples=2, temperature=0.0))
    tokens = greedy[0][0]
    stop_string = session.detokenize([tokens[:2]])[0].strip()[-3:]
    return {
        "greedy": greedy,
        "stop_token": _sampled(
            session.sample(prompt, max_tokens=8, temperature=0.0, stop_tokens=[tokens[2]])
        ),
        "stop_string": _sampled(
            session.sample(prompt, max_tokens=8, temperature=0.0, stop_strings=[stop_string])
        ),
    }


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded-sampling")
    reports = workers.launch(2, "sampling", {"model": str(tiny_llama), "out": str(out)})
    for report in reports:
        report["out"] = str(out)
    return reports


@pytest.fixture(scope="module")
def one_process(two_ranks, tiny_llama: Path) -> dict[str, Any]:
    """One process sampling the weights the ranks sampled: the base model, and the ranks'
    export (read as other weights, then loaded). Their live weights are not one process's:
    training sums a batch's gradients in another order on two ranks (test_sharded_session)."""
    out = Path(two_ranks[0]["out"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (sharded_workers)
    try:
        report = {}
        for mode, lora in MODES.items():
            session = _open(str(tiny_llama), None, lora)
            prompt = session.tokenize(["the movie was"])[0]
            export = out / mode / "export"
            seen = {"fresh": _sampled(session.sample(prompt, **OPTIONS))}
            seen["alone"] = _decoded_alone(session, prompt, None)
            seen["export"] = _sampled(session.sample(prompt, weights=export, **OPTIONS))
            session.load_weights(export)
            seen["loaded"] = _sampled(session.sample(prompt, **OPTIONS))
            seen["export_prompt"] = session.prompt_logprobs(prompt)[1:]
            report[mode] = seen
    finally:
        torch.set_num_threads(threads)
    return json.loads(json.dumps(report))  # tuples as the ranks' JSON holds them


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_answers_alike_and_the_same_call_twice_samples_the_same(two_ranks, mode) -> None:
    first, second = (report[mode] for report in two_ranks)
    assert first == second
    assert first["live"] == first["again"]
    assert len({tuple(tokens) for tokens, _, _ in first["live"]}) > 1  # really drawn


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_sample_has_exactly_the_logprobs_its_own_forward_gives(two_ranks, mode) -> None:
    seen = two_ranks[0][mode]
    assert [logprobs for _, logprobs, _ in seen["live"]] == seen["forward"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_sample_and_score_exactly_what_one_process_does(
    two_ranks, one_process, mode
) -> None:
    """On the same weights, the ranks' forwards gather every weight whole and run the one
    process's kernels on the same shapes, on one thread each: the same bits, not merely close
    ones (samples, their logprobs, prompt logprobs)."""
    seen = two_ranks[0][mode]
    for key, expected in one_process[mode].items():
        assert seen[key] == expected, key


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_sampling_changes_no_state_and_training_goes_on_as_without_it(two_ranks, mode) -> None:
    seen = two_ranks[0][mode]
    assert seen["digest_unchanged"]
    assert seen["trains_on_as_without_sampling"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_greedy_stop_tokens_and_stop_strings_end_sharded_samples(two_ranks, mode) -> None:
    seen = two_ranks[0][mode]
    (greedy, _, _), again = seen["greedy"][0], seen["greedy"][1]
    assert again[0] == greedy
    ((stopped, _, reason),) = seen["stop_token"]
    assert reason == "stop" and stopped == greedy[: greedy.index(greedy[2]) + 1]
    ((ended, _, reason),) = seen["stop_string"]
    assert reason == "stop" and ended == greedy[: len(ended)] and len(ended) <= 2
    assert seen["prompt_nan"] and len(seen["prompt"]) == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_other_weights_are_swapped_into_the_shards_and_the_live_ones_put_back(
    two_ranks, mode
) -> None:
    seen = two_ranks[0][mode]
    assert seen["export"] == seen["loaded"]  # a session that loaded the export samples alike
    assert seen["base"] == seen["fresh"]  # the base model samples as a fresh session
    assert seen["export"] != seen["live"] != seen["base"]
    assert seen["export_prompt"] != seen["prompt"]
    assert seen["missing"].startswith("FailedPrecondition: no weights to sample at 'removed'")
    assert seen["digest_unchanged"]


# -- served: trainwire serve --nproc 2 -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_served_two_rank_group_samples_for_tinker_and_grpc_and_trains_on(
    tmp_path, model_root, tiny_llama
) -> None:
    key_file = tmp_path / "tinker.key"
    key_file.write_text(KEY)
    grpc_target, tinker_port = f"127.0.0.1:{free_port()}", free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "trainwire", "serve", "--listen", grpc_target,
         "--state-dir", str(tmp_path / "state"), "--model-root", str(model_root),
         "--device", "cpu", "--tinker-listen", f"127.0.0.1:{tinker_port}",
         "--tinker-token-file", str(key_file), "--token-file", str(key_file), "--nproc", "2"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    service = None
    try:
        client = SessionClient(grpc_target, token=KEY)
        client.wait_until_serving(timeout_s=120)
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{tinker_port}", api_key=KEY)
        training = service.create_lora_training_client(base_model="llama", rank=4).result()
        tokenizer = training.get_tokenizer()
        # Before any update, the group samples what one process does with the run's config.
        prompt = tokenizer.encode("the cat sat")
        options = {"max_tokens": 5, "num_samples": 3, "seed": 11}
        grouped = client.sample(prompt, **options)
        expected = _one_process_samples(tmp_path / "state", model_root, client, prompt, options)
        assert grouped == expected
        assert len({s.tokens for s in grouped}) > 1  # really drawn
        # An SDK RL step: a snapshot's sampling client samples one completion, which trains.
        # Alone in its batch, its sampler logprobs are the trainer's bit for bit.
        sampled, trained, _ = rl_step(training, tokenizer, "importance_sampling", seed=3, group=1)
        assert sampled == trained and len(sampled[0]) > 0
        sampler = training.save_weights_and_get_sampling_client().result(timeout=120)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result(timeout=120)
        assert scored[0] is None and len(scored) == len(prompt)
        # gRPC Sample of the live weights: the same call twice, the same samples.
        first = client.sample(prompt, max_tokens=5, num_samples=2, seed=11)
        assert client.sample(prompt, max_tokens=5, num_samples=2, seed=11) == first
        assert len(first) == 2 and all(0 < len(s.tokens) <= 5 for s in first)
        # A refusal every rank makes alike in the engine (no microbatch to update with) is
        # answered, and the group goes on.
        with pytest.raises(grpc.RpcError) as refused:
            client.optim_step(operation_key="nothing-accumulated")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no microbatch accumulated" in refused.value.details()
        # The group trains on: every rank is still in step, and the update moves the state.
        before = client.info()
        datum = supervised_datum(tokenizer, "a dog ran in the park")
        training.forward_backward([datum], "cross_entropy").result(timeout=120)
        step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        assert step.metrics["learning_rate:mean"] == 1e-2
        assert step.metrics["grad_norm:mean"] > 0
        info = client.info()
        assert (info.step, info.position) == (2, before.position + 2)
        assert info.state_digest not in ("", before.state_digest)
        client.close_channel()
    finally:
        if service is not None:
            close_quietly(service)
        server.terminate()
        server.wait(60)


def _one_process_samples(
    state_dir: Path,
    model_root: Path,
    client: SessionClient,
    prompt: list[int],
    options: dict[str, Any],
) -> list[Sample]:
    """What one process on one thread (as each rank runs) samples from a fresh session of the
    served run's configuration (``run.json``)."""
    spec = json.loads((state_dir / "runs" / client.info().run_id / "run.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        session = TrainingSession(
            TrainingConfig.from_dict(spec["config"]), device="cpu", model_root=model_root
        )
        return session.sample(prompt, **options)
    finally:
        torch.set_num_threads(threads)
