"""Checkpoints outlive the SDK session that saved them: a later ServiceClient continues a run from
one bit for bit (``create_training_client_from_state_with_optimizer``), starts from its weights
alone, samples its sampler weights, and takes weights away through signed URLs, which the
cookbook's ``weights.download`` turns into an adapter PEFT loads with the server's logits."""

from __future__ import annotations

import time
import types as pytypes
from pathlib import Path
from typing import Any

import httpx
import pyrage
import pytest
import tinker
import torch
from tinker import types
from tinker_loops import (
    KEY,
    SENTENCES,
    SdkRun,
    lora_training,
    service_client,
    supervised_datum,
    tinker_server,
    train_step,
)
from transformers import AutoTokenizer

from trainwire.server.process import ServerHandle
from trainwire.server.tinker import external_weights
from trainwire.server.tinker.external_weights import EXPORT_PREFIX
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.start_from import START_CHECKPOINT

pytestmark = pytest.mark.slow  # ~35 s of servers and SDK clients; make test stays short
KEY_TEXT = SENTENCES[2]  # the datum every comparison trains or scores on


def rest_client(handle: ServerHandle) -> tinker.RestClient:
    return tinker.RestClient(base_url=handle.tinker.base_url, api_key=KEY)


def train_twice_and_save(run: SdkRun, name: str = "mid") -> str:
    """Two supervised steps, then ``save_state(name)``: the checkpoint's tinker path."""
    train_step(run, SENTENCES[0])
    train_step(run, SENTENCES[1])
    return run.training.save_state(name).result().path


def close(service: tinker.ServiceClient) -> None:
    service.close("success").result(timeout=30)


def step_on(training: Any, tokenizer: Any) -> tuple[float, list[list[float]]]:
    """forward_backward on ``KEY_TEXT`` then optim_step: the loss and logprobs it reported."""
    out = training.forward_backward([supervised_datum(tokenizer, KEY_TEXT)], "cross_entropy")
    result = out.result(timeout=60)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=60)
    return result.metrics["loss:sum"], [o["logprobs"].tolist() for o in result.loss_fn_outputs]


def forward_logprobs(training: Any, tokenizer: Any) -> list[float]:
    datum = supervised_datum(tokenizer, KEY_TEXT)
    (out,) = training.forward([datum], "cross_entropy").result(timeout=60).loss_fn_outputs
    return out["logprobs"].tolist()


def test_continuing_with_the_optimizer_after_the_client_closed_equals_a_run_that_never_stopped(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "uninterrupted", model_root) as run:
        train_step(run, SENTENCES[0])
        train_step(run, SENTENCES[1])
        expected = step_on(run.training, run.tokenizer)
        expected_digest = run.handle.session_host.info().state_digest
    with lora_training(tmp_path / "resumed", model_root) as run:
        path = train_twice_and_save(run)
        close(run.service)
        assert run.handle.session_host.info().state == "closed"
        later = service_client(run.handle)
        resumed = later.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.model_id != run.training.model_id  # a new run, continuing the old one
        assert run.handle.session_host.info().step == 2
        assert step_on(resumed, run.tokenizer) == expected
        assert run.handle.session_host.info().state_digest == expected_digest
        run_checkpoints = tmp_path / "resumed" / "runs" / run_id_for(resumed.model_id)
        assert (run_checkpoints / "checkpoints" / START_CHECKPOINT).is_dir()  # its first


def test_starting_from_the_weights_alone_keeps_the_weights_with_a_fresh_optimizer(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        path = train_twice_and_save(run)
        saved_logprobs = forward_logprobs(run.training, run.tokenizer)
        close(run.service)
        host = run.handle.session_host

        continued_client = service_client(run.handle)
        continued = continued_client.create_training_client_from_state_with_optimizer(path)
        continued = continued.result()
        step_on(continued, run.tokenizer)
        continued_info = host.info()
        close(continued_client)

        fresh = service_client(run.handle).create_training_client_from_state(path).result()
        assert host.info().step == 0  # a fresh optimizer and schedule
        assert forward_logprobs(fresh, run.tokenizer) == saved_logprobs  # the saved weights
        step_on(fresh, run.tokenizer)
        assert (continued_info.step, host.info().step) == (3, 1)
        assert host.info().state_digest != continued_info.state_digest


def test_a_start_from_state_that_cannot_be_is_refused_with_the_reason_and_opens_nothing(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        path = run.training.save_state("saved").result().path
        sampler = run.training.save_weights_for_sampler("sampler").result().path
        model_id = run.training.model_id
        close(run.service)
        later = service_client(run.handle)
        with pytest.raises(tinker.BadRequestError, match="continues that configuration only"):
            later.create_training_client_from_state_with_optimizer(
                path, base_model="another-llama"
            ).result()
        with pytest.raises(tinker.BadRequestError, match="not from sampler weights"):
            later.create_training_client_from_state(sampler).result()
        with pytest.raises(tinker.NotFoundError, match="deleted or expired"):
            later.create_training_client_from_state(f"tinker://{model_id}/weights/nope").result()
        with pytest.raises(tinker.NotFoundError, match="deleted or expired"):
            later.create_training_client_from_state("tinker://tw-0:train:0/weights/saved").result()
        assert run.handle.session_host.info().state == "closed"  # nothing opened
        runs = rest_client(run.handle).list_training_runs().result()
        assert [r.training_run_id for r in runs.training_runs] == [model_id]


def sample_of(sampling: Any, tokenizer: Any) -> list[tuple[list[int], list[float] | None]]:
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    result = sampling.sample(prompt, 3, params).result(timeout=60)
    return [(list(s.tokens), s.logprobs) for s in result.sequences]


def test_sampler_weights_of_a_closed_run_sample_as_they_did_before_it_closed(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        train_step(run, SENTENCES[0])
        path = run.training.save_weights_for_sampler("snap").result().path
        tokenizer = run.tokenizer
        before = sample_of(run.service.create_sampling_client(model_path=path).result(), tokenizer)
        base = sample_of(run.service.create_sampling_client(base_model="llama").result(), tokenizer)
        assert before != base  # the snapshot is the trained weights
        close(run.service)
        # A later script: a new run on the base model, and the closed run's sampler weights.
        later = service_client(run.handle)
        later.create_lora_training_client(base_model="llama", rank=4).result()
        saved = later.create_sampling_client(model_path=path).result()
        assert sample_of(saved, tokenizer) == before
        assert sample_of(later.create_sampling_client(base_model="llama").result(), tokenizer) == (
            base
        )


def test_sampler_weights_of_a_closed_run_sample_with_no_model_open_until_one_is_created(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """An evaluation script after training: only a sampling client, no training client. The
    server opens a run of the saved run's configuration to sample on; a model created later
    takes its place."""
    with lora_training(tmp_path / "state", model_root) as run:
        train_step(run, SENTENCES[0])
        path = run.training.save_weights_for_sampler("snap").result().path
        tokenizer = run.tokenizer
        before = sample_of(run.service.create_sampling_client(model_path=path).result(), tokenizer)
        close(run.service)
        later = service_client(run.handle)
        saved = later.create_sampling_client(model_path=path).result()
        assert sample_of(saved, tokenizer) == before
        assert run.handle.session_host.open_run_id.startswith("tinker-sampling-")
        training = later.create_lora_training_client(base_model="llama", rank=4).result()
        assert forward_logprobs(training, tokenizer)  # the model's own run took its place
        assert not run.handle.session_host.open_run_id.startswith("tinker-sampling-")


def test_the_base_model_samples_before_any_training_client_as_it_does_beside_one(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """An evaluation of the base before training: only a sampling client of the base model.
    The server opens a run of it to sample on (it refused, asking for a training client first);
    the samples are those the base gives beside a training client, bit for bit, and a model
    created later takes the sampling run's place."""
    with tinker_server(tmp_path / "state", model_root) as handle:
        service = service_client(handle)
        base = service.create_sampling_client(base_model="llama").result()
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # the SDK's looks on the hub
        before = sample_of(base, tokenizer)
        assert handle.session_host.open_run_id.startswith("tinker-sampling-")
        service.create_lora_training_client(base_model="llama", rank=4).result()
        assert not handle.session_host.open_run_id.startswith("tinker-sampling-")
        assert sample_of(base, tokenizer) == before
        again = service.create_sampling_client(base_model="llama").result()
        assert sample_of(again, tokenizer) == before


def test_a_base_model_sample_whose_run_must_open_while_a_model_is_being_created_never_hangs(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """A create_model (or a close) holds the model table while it waits for the engine thread
    to open (or close) its run; a base-model sample with no model open opens its sampling run at
    its turn, on that thread. The sample waits a bounded time for the table and is then refused
    (send it again: the model being created samples it then), never stopping the engine and the
    create with it (they waited for each other for good)."""
    with tinker_server(tmp_path / "state", model_root) as handle:
        service = service_client(handle)
        base = service.create_sampling_client(base_model="llama").result()
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)  # the SDK's looks on the hub
        models, engine = handle.tinker.front.models, handle.session_host.scheduler
        with models._lock:  # as create_model holds it while its open waits for the engine
            refused = pytest.raises(tinker.RequestFailedError, match="being created or closed")
            with refused:
                sample_of(base, tokenizer)
            assert engine.queue(lambda: "ran").result(timeout=30) == "ran"  # not stopped
        assert sample_of(base, tokenizer)  # sent again: its sampling run opens


def export_folder(handle: ServerHandle, model_id: str, name: str) -> Path:
    """Where the server wrote external weights ``name`` of run ``model_id``."""
    return handle.session_host.state_dir.run(run_id_for(model_id)).export(EXPORT_PREFIX + name)


def test_external_weights_download_without_the_key_from_urls_that_are_signed_and_expire(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        train_step(run, SENTENCES[0])
        model_id, rest = run.training.model_id, rest_client(run.handle)
        path = run.training.save_weights_external("final", ttl_seconds=3600).result().path
        assert path == f"tinker://{model_id}/external_weights/final"
        urls = rest.get_external_weights_urls(path).result().urls
        folder = export_folder(run.handle, model_id, "final")
        on_disk = {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}
        assert set(urls) == set(on_disk) and "adapter_config.json" in urls
        for name, url in urls.items():
            response = httpx.get(url, timeout=60)  # no API key: the URL is the credential
            assert response.status_code == 200, response.text
            assert response.content == on_disk[name].read_bytes()

        url = urls["adapter_config.json"]
        head, signature = url.rsplit(".", 1)
        tampered = f"{head}.{signature[:-1]}{'A' if signature[-1] != 'A' else 'B'}"
        assert httpx.get(tampered, timeout=60).status_code == 401
        later = time.time() + external_weights.URL_TTL_S + 1
        with monkeypatch.context() as m:
            m.setattr(external_weights, "time", pytypes.SimpleNamespace(time=lambda: later))
            expired = httpx.get(url, timeout=60)
        assert expired.status_code == 401 and "expired" in expired.json()["detail"]
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert httpx.get(url, timeout=60).status_code == 404
        assert not folder.exists()
        with pytest.raises(tinker.NotFoundError):
            rest.get_external_weights_urls(path).result()


def test_encrypted_external_weights_download_only_as_age_files_for_the_recipient(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    identity = pyrage.x25519.Identity.generate()
    with lora_training(tmp_path / "state", model_root) as run:
        model_id, rest = run.training.model_id, rest_client(run.handle)
        recipients = [str(identity.to_public())]
        path = run.training.save_weights_external("sealed", age_encryption_recipients=recipients)
        urls = rest.get_external_weights_urls(path.result().path).result().urls
        folder = export_folder(run.handle, model_id, "sealed")
        plain = {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}
        assert set(urls) == {f"{name}.age" for name in plain}
        for name, file in plain.items():
            sealed = httpx.get(urls[f"{name}.age"], timeout=60).content
            assert sealed != file.read_bytes()
            assert pyrage.decrypt(sealed, [identity]) == file.read_bytes()


def test_the_cookbook_downloads_a_training_checkpoint_as_an_adapter_with_the_servers_logits(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from peft import PeftModel
    from tinker_cookbook import weights
    from transformers import AutoModelForCausalLM

    with lora_training(tmp_path / "state", model_root) as run:
        path = train_twice_and_save(run, "final")
        server_logprobs = forward_logprobs(run.training, run.tokenizer)
        close(run.service)  # the download starts its own run from the checkpoint
        monkeypatch.setenv("TINKER_API_KEY", KEY)
        adapter = tmp_path / "adapter"
        weights.download(
            tinker_path=path, output_dir=str(adapter), base_url=run.handle.tinker.base_url
        )
        assert (adapter / "adapter_config.json").is_file()
        # The download's own export is deleted once fetched; the checkpoint stays.
        listed = rest_client(run.handle).list_user_checkpoints().result().checkpoints
        assert [c.tinker_path for c in listed] == [path]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    tokens = run.tokenizer.encode(KEY_TEXT)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    targets = torch.tensor(tokens[1:])
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (picked - torch.logsumexp(logits, dim=-1)).tolist() == server_logprobs
