"""Concurrent samples through gRPC and through the Tinker SDK's futures decode as one batch, and
each request gets the bits it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from sample_requests import held_executor, mixed_requests, spy_batches
from service_fixtures import connect, running_server, wait_for
from tinker import types
from tinker_loops import lora_training

from trainwire.server.service import operations as ops
from trainwire.server.service.requests import TokenizeRequest


def test_concurrent_grpc_samples_decode_together_each_as_alone(
    tmp_path, model_root, llama_config, monkeypatch
):
    with running_server(tmp_path / "state", model_root) as handle:
        client = connect(handle)
        client.open("run", llama_config())
        host = handle.session_host
        requests = mixed_requests(host.session.sampler.vocab_size)

        def sample(request):
            return client.sample(request.prompt_tokens, **request.sampling_settings())

        expected = [sample(r) for r in requests]
        sizes = spy_batches(monkeypatch)
        started, release = held_executor(host, monkeypatch)
        with ThreadPoolExecutor(len(requests) + 1) as pool:
            held = pool.submit(host.apply, ops.TOKENIZE, TokenizeRequest(["x"]))
            assert started.wait(30)
            futures = [pool.submit(sample, r) for r in requests]
            wait_for(lambda: host.scheduler.waiting == len(requests) + 1)
            release.set()
            held.result(timeout=60)
            assert [f.result(timeout=120) for f in futures] == expected
        assert sizes == [len(requests)]
        client.close()


def test_tinker_asample_futures_sent_at_once_decode_together_each_as_alone(
    tmp_path, model_root, monkeypatch
):
    with lora_training(tmp_path / "state", model_root) as run:
        sampler = run.training.save_weights_and_get_sampling_client().result(timeout=60)
        host = run.handle.session_host
        shapes = [  # prompt, samples, params: other lengths, seeds and max_tokens
            ("the cat", 3, types.SamplingParams(max_tokens=7, temperature=1.0, seed=1)),
            ("a dog ran in", 2, types.SamplingParams(max_tokens=4, top_p=0.9, seed=2)),
            ("birds", 4, types.SamplingParams(max_tokens=9, top_k=20, seed=3)),
            ("the cat sat on the", 1, types.SamplingParams(max_tokens=5, temperature=0.0)),
        ]

        def send(text, samples, params):
            prompt = types.ModelInput.from_ints(run.tokenizer.encode(text))
            return sampler.sample(prompt, samples, params)

        def bits(response):
            return [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences]

        expected = [bits(send(*shape).result(timeout=60)) for shape in shapes]
        sizes = spy_batches(monkeypatch)
        started, release = held_executor(host, monkeypatch)
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(host.apply, ops.TOKENIZE, TokenizeRequest(["x"]))
            assert started.wait(30)
            futures = [send(*shape) for shape in shapes]  # the SDK's futures, all in flight
            wait_for(lambda: host.scheduler.queued == len(shapes) + 1)
            release.set()
            held.result(timeout=60)
            assert [bits(f.result(timeout=120)) for f in futures] == expected
        assert sizes == [len(shapes)]
