"""The real Tinker SDK (from PyPI) against a real trainwire server on loopback: supervised and RL
loops as the SDK's docs write them, unchanged but for base_url and the key."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch
from fresh_state import fresh_server_info
from tinker import types
from tinker_loops import (
    KEY,
    SENTENCES,
    lora_training,
    rl_step,
    service_client,
    supervised_datum,
    supervised_loop,
    tinker_server,
    train_step,
)

from trainwire.testing import make_tiny_model


def test_supervised_loop_loss_falls_and_repeats_bit_for_bit(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    runs = []
    for name in ("first", "second"):
        with tinker_server(tmp_path / name, model_root) as handle:
            service = service_client(handle)
            runs.append(supervised_loop(service))
            service.close("success").result()
    first, second = runs
    assert first == second
    assert first[-1] < first[0]


def test_rl_loop_sample_logprobs_are_the_trainers_bit_for_bit(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        training_client, tokenizer = run.training, run.tokenizer
        for step, loss_fn in enumerate(("importance_sampling", "ppo")):
            sampled, trained, _ = rl_step(training_client, tokenizer, loss_fn, seed=step)
            # A group trains as one padded batch, whose kernels round differently from a batch of
            # one in the last bits (an engine limitation, reported): close, not equal.
            for sample, train in zip(sampled, trained, strict=True):
                assert sample == pytest.approx(train, rel=1e-5)
        # One sample trained alone: the sampler's logprobs are the trainer's, bit for bit.
        sampled, trained, _ = rl_step(training_client, tokenizer, "importance_sampling", 5, 1)
        assert sampled == trained


def test_compute_logprobs_equal_forward_and_custom_loss_trains(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        training_client, tokenizer = run.training, run.tokenizer
        datum = supervised_datum(tokenizer, SENTENCES[0])
        forward = training_client.forward([datum], "cross_entropy").result()
        sampling_client = training_client.save_weights_and_get_sampling_client().result()
        tokens = tokenizer.encode(SENTENCES[0])
        scored = sampling_client.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert scored[0] is None
        assert scored[1:] == forward.loss_fn_outputs[0]["logprobs"].tolist()

        def mean_nll(data: list[types.Datum], logprobs: list[torch.Tensor]):
            loss = -torch.cat(logprobs).mean()
            return loss, {"nll:mean": loss.item()}

        first = training_client.forward_backward_custom([datum], mean_nll).result()
        training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        second = training_client.forward_backward_custom([datum], mean_nll).result()
        assert math.isclose(first.metrics["loss:sum"], first.metrics["nll:mean"], rel_tol=1e-6)
        assert second.metrics["loss:sum"] < first.metrics["loss:sum"]


def test_a_wrong_or_missing_key_is_refused(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tinker

    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with tinker_server(tmp_path / "state", model_root) as handle:
        with pytest.raises(tinker.AuthenticationError, match="wrong API key"):
            service_client(handle, key="tml-wrong").create_lora_training_client(
                base_model="llama", rank=4
            ).result()
        url = f"{handle.tinker.base_url}/api/v1/create_session"
        response = httpx.post(url, json={})
        assert response.status_code == 401
        assert "X-API-Key" in response.json()["detail"]
        assert httpx.post(url, json={}, headers={"X-API-Key": KEY}).status_code == 200


def test_refusals_are_clear_and_change_nothing(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    import tinker

    with lora_training(tmp_path / "state", model_root) as run:
        handle, service, training_client = run.handle, run.service, run.training
        with pytest.raises(tinker.BadRequestError, match="one server, one model"):
            service.create_lora_training_client(base_model="llama", rank=4).result()
        with pytest.raises(tinker.BadRequestError, match=r"beta2 must be in \[0, 1\)"):
            training_client.optim_step(types.AdamParams(learning_rate=1e-3, beta2=1.5)).result()
        with pytest.raises(tinker.BadRequestError, match="save_weights path name"):
            training_client.save_state("../escape").result()
        info = handle.session_host.info()
        assert info.position == 0 and info.step == 0
        # The refused calls took their seq_ids: the calls numbered after them are not held.
        train_step(run, SENTENCES[0], learning_rate=1e-3)
        assert handle.session_host.info().step == 1
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
        sample = {"sampling_session_id": "nope", "seq_id": 1, "prompt": prompt}
        sample["sampling_params"] = {"max_tokens": 2}
        url = f"{handle.tinker.base_url}/api/v1/asample"
        response = httpx.post(url, json=sample, headers={"X-API-Key": KEY})
        assert response.status_code == 404
        assert "create a sampling client first" in response.json()["detail"]


def test_a_sampling_client_keeps_sampling_its_snapshot_after_the_trainer_steps(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        handle, training_client, tokenizer = run.handle, run.training, run.tokenizer
        prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        old = training_client.save_weights_and_get_sampling_client().result()
        before = old.sample(prompt, 2, params).result()
        train_step(run, SENTENCES[0])
        digest = fresh_server_info(handle).state_digest
        again = old.sample(prompt, 2, params).result()
        new = training_client.save_weights_and_get_sampling_client().result()
        moved = new.sample(prompt, 2, params).result()
        assert [(s.tokens, s.logprobs) for s in again.sequences] == [
            (s.tokens, s.logprobs) for s in before.sequences
        ]
        assert [s.logprobs for s in moved.sequences] != [s.logprobs for s in before.sequences]
        assert fresh_server_info(handle).state_digest == digest  # sampling changed nothing


def test_the_tokenizer_id_the_sdk_loads_is_configurable(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    for name, options, expected in (
        ("default", {}, str(tiny_llama.resolve())),
        ("named", {"tinker_tokenizer_id": "org/tokenizer"}, "org/tokenizer"),
    ):
        with tinker_server(tmp_path / name, model_root, **options) as handle:
            service = service_client(handle)
            training = service.create_lora_training_client(base_model="llama", rank=4).result()
            assert training.get_info().model_data.tokenizer_id == expected


def test_named_sampler_weights_keep_their_snapshot_and_their_name(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    import tinker

    with lora_training(tmp_path / "state", model_root) as run:
        service, training_client, tokenizer = run.service, run.training, run.tokenizer
        prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
        path = training_client.save_weights_for_sampler("first").result().path
        sampler = service.create_sampling_client(model_path=path)
        before = sampler.sample(prompt, 2, params).result()
        train_step(run, SENTENCES[1])
        later = service.create_sampling_client(model_path=path).sample(prompt, 2, params).result()
        assert [s.logprobs for s in later.sequences] == [s.logprobs for s in before.sequences]
        with pytest.raises(tinker.RequestFailedError, match="exist already"):
            training_client.save_weights_for_sampler("first").result()


def test_optim_step_adds_the_gradients_of_every_forward_backward_as_tinker_does(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    norms = []
    for calls in (1, 2):
        with lora_training(tmp_path / f"calls-{calls}", model_root) as run:
            datum = supervised_datum(run.tokenizer, SENTENCES[2])
            for _ in range(calls):
                run.training.forward_backward([datum], "cross_entropy").result()
            step = run.training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            norms.append(step.metrics["grad_norm:mean"])
    assert norms[1] == 2 * norms[0]  # (g + g), not (g + g) / 2


def test_capabilities_list_the_model_roots_models_and_health_answers(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with tinker_server(tmp_path / "state", model_root) as handle:
        service = service_client(handle)
        models = {m.model_name: m for m in service.get_server_capabilities().supported_models}
        assert models["llama"].sampleable and models["llama"].trainable
        assert models["llama"].max_context_length > 0
        health = httpx.get(f"{handle.tinker.base_url}/api/v1/healthz", headers={"X-API-Key": KEY})
        assert health.json() == {"status": "ok"}


def test_a_second_training_client_from_state_while_one_trains_is_refused_with_the_reason(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    import tinker

    with lora_training(tmp_path / "state", model_root) as run:
        datum = supervised_datum(run.tokenizer, SENTENCES[0])
        run.training.forward_backward([datum], "cross_entropy").result()
        path = run.training.save_state("kept").result().path
        with pytest.raises(tinker.APIStatusError, match="one server, one model"):
            run.service.create_training_client_from_state(path).result()
        run.training.load_state(path).result()  # into the model that saved it: served


def test_every_adam_param_applies_to_its_update_and_bad_ones_are_refused(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    import tinker

    digests = []
    for name, eps in (("sdk-default", 1e-12), ("cookbook", 1e-8), ("cookbook-again", 1e-8)):
        with lora_training(tmp_path / name, model_root) as run:
            datum = supervised_datum(run.tokenizer, SENTENCES[0])
            run.training.forward_backward([datum], "cross_entropy").result()
            params = types.AdamParams(learning_rate=5e-2, eps=eps, beta2=0.99, weight_decay=0.01)
            run.training.optim_step(params).result()
            digests.append(run.handle.session_host.info().state_digest)
            if name == "cookbook":
                with pytest.raises(tinker.BadRequestError, match="beta1 must be in"):
                    run.training.optim_step(types.AdamParams(beta1=1.5)).result()
                # A scheduler's NaN or infinity (sent as null) is refused, not read as 1e-4.
                for rate in (float("nan"), float("inf")):
                    with pytest.raises(tinker.BadRequestError, match="finite number, got null"):
                        run.training.optim_step(types.AdamParams(learning_rate=rate)).result()
                assert run.handle.session_host.info().state_digest == digests[-1]
    assert digests[0] != digests[1] == digests[2]


def test_a_base_model_sampling_client_samples_the_model_it_names_or_is_refused(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """The base model a sampling client names is the one it samples: an unknown name is a 404
    when the client is made, and a model under the root that no open model trains is refused
    at the sample (each once sampled the open model's base, silently)."""
    import tinker

    other = model_root / "llama-seed-1"
    if not other.exists():
        make_tiny_model(other, seed=1)
    with lora_training(tmp_path / "state", model_root) as run:
        prompt = types.ModelInput.from_ints(run.tokenizer.encode(SENTENCES[0]))
        params = types.SamplingParams(max_tokens=4, seed=5)
        base = run.service.create_sampling_client(base_model="llama").result(timeout=60)
        assert len(base.sample(prompt, 1, params).result(timeout=60).sequences[0].tokens) == 4
        with pytest.raises(tinker.NotFoundError, match="no model 'Qwen/Qwen3-8B' under the"):
            run.service.create_sampling_client(base_model="Qwen/Qwen3-8B").result(timeout=60)
        elsewhere = run.service.create_sampling_client(base_model="llama-seed-1").result()
        with pytest.raises(tinker.RequestFailedError, match="samples 'llama-seed-1'; the open"):
            elsewhere.sample(prompt, 1, params).result(timeout=60)
