"""``copy_weights``: a checkpoint copied into a new closed run, exactly once by the SDK's
idempotency key (also across a SIGKILL), its files sharing the source's storage, and usable as
any checkpoint: a run starts from it, and it outlives the deletion of its source."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import tinker
from test_tinker_restart import TinkerServeProcess
from tinker import types
from tinker_loops import KEY, close_quietly, lora_training, supervised_datum

from trainwire.server.tinker.model import run_id_for
from trainwire.testing import free_port


def copy(base_url: str, body: dict, key: str) -> httpx.Response:
    headers = {"X-API-Key": KEY, "X-Idempotency-Key": key}
    return httpx.post(f"{base_url}/api/v1/copy_weights", json=body, headers=headers, timeout=60)


def copies_of(base_url: str, source: str) -> list[str]:
    runs = httpx.get(
        f"{base_url}/api/v1/training_runs",
        params={"limit": 100},
        headers={"X-API-Key": KEY},
        timeout=60,
    ).json()["training_runs"]
    return [
        run["training_run_id"]
        for run in runs
        if (run.get("user_metadata") or {}).get("copied_from") == source
    ]


def test_a_copy_is_made_once_per_key_shares_its_files_and_outlives_its_source(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with lora_training(state_dir, model_root, max_runs=2) as run:
        datum = supervised_datum(run.tokenizer, "the cat sat on the mat")
        run.training.forward_backward([datum], "cross_entropy").result()
        run.training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        source = run.training.save_state("trained").result().path
        base_url = run.handle.tinker.base_url
        body = {"source_path": source, "destination_project_id": "archive"}
        first = copy(base_url, body, "key-1")
        assert first.status_code == 200, first.text
        copied = first.json()["tinker_path"]
        assert copy(base_url, body, "key-1").json() == first.json()  # a retry: the same copy
        assert copies_of(base_url, source) == [copied.split("/")[2]]
        other = copy(base_url, {**body, "destination_project_id": "elsewhere"}, "key-1")
        assert other.status_code == 400 and "another copy" in other.text
        assert copies_of(base_url, source) == [copied.split("/")[2]]

        original = state_dir / "runs" / run_id_for(run.training.model_id) / "checkpoints"
        duplicate = state_dir / "runs" / run_id_for(copied.split("/")[2]) / "checkpoints"
        weights = next(p for p in (original / "trained").iterdir() if p.is_file())
        assert os.stat(weights).st_ino == os.stat(duplicate / "trained" / weights.name).st_ino

        rest = tinker.RestClient(base_url=base_url, api_key=KEY)
        rest.delete_checkpoint_from_tinker_path(source).result()
        started = run.service.create_training_client_from_state_with_optimizer(copied).result()
        from_copy = started.forward_backward([datum], "cross_entropy").result()
        from_source = run.training.forward_backward([datum], "cross_entropy").result()
        assert from_copy.metrics == from_source.metrics  # the same weights and state


@pytest.mark.slow
def test_a_copy_answered_before_a_sigkill_is_the_copy_its_retry_gets_after(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    port, state_dir = free_port(), tmp_path / "state"
    started = [TinkerServeProcess(tmp_path, state_dir, model_root, port, "first")]
    base_url = f"http://127.0.0.1:{port}"
    try:
        service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
        training = service.create_lora_training_client(base_model="llama", rank=4).result()
        source = training.save_weights_for_sampler("snap").result().path
        close_quietly(service)
        body = {"source_path": source, "destination_project_id": "archive"}
        copied = copy(base_url, body, "the-key").json()["tinker_path"]
        started[-1].kill()
        started.append(TinkerServeProcess(tmp_path, state_dir, model_root, port, "second"))
        assert copy(base_url, body, "the-key").json()["tinker_path"] == copied
        assert copies_of(base_url, source) == [copied.split("/")[2]]
        service = tinker.ServiceClient(base_url=base_url, api_key=KEY)
        try:
            sampler = service.create_sampling_client(model_path=copied).result()
            params = types.SamplingParams(max_tokens=3, temperature=0.0)
            prompt = types.ModelInput.from_ints([1, 2, 3])
            assert sampler.sample(prompt, 1, params).result().sequences[0].tokens
        finally:
            close_quietly(service)
    finally:
        for process in started:
            process.kill()
