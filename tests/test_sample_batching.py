"""Concurrent sample requests decode as one batch, and each gets exactly what it gets alone.

A request's samples depend only on its own prompt, seed and settings: sampled alone, or among
requests of other prompt lengths, seeds, sample counts and max_tokens (some stopping early),
joining at a later step or not, its tokens and logprobs are the same bits.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from host_operations import run_ops
from sample_requests import held_executor, mixed_requests, prompts, spy_batches
from service_fixtures import wait_for

from trainwire.client import LoraSettings
from trainwire.server.engine.sampling import batch_decode
from trainwire.server.engine.sampling.batch_decode import tile_rows_for
from trainwire.server.engine.sampling.sample_weights import LIVE_WEIGHTS
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import operations as ops
from trainwire.server.service import reads, sample_batching
from trainwire.server.service.host import SessionHost
from trainwire.server.service.requests import SampleRequest, TokenizeRequest


def alone(session: TrainingSession, request: SampleRequest) -> list:
    return session.sample(request.prompt_tokens, **request.sampling_settings())


def batched(request: SampleRequest, results: dict[int, object], index: int):
    def on_result(samples, scored):
        results[index] = (samples, scored)

    def on_error(error):
        results[index] = error

    params = sample_batching.params_of(request)
    return BatchedSample(
        list(request.prompt_tokens), params, reads.prompt_scoring(request), on_result, on_error
    )


@pytest.fixture(params=["full", "lora"])
def session(request, llama_config) -> TrainingSession:
    lora = LoraSettings(r=4, alpha=8, dropout=0.0) if request.param == "lora" else None
    return TrainingSession(llama_config(lora=lora, lr_scheduler="constant"), device="cpu")


def test_a_request_gets_the_same_bits_alone_and_among_others_joining_at_later_steps(session):
    requests = mixed_requests(session.sampler.vocab_size)
    expected = [alone(session, r) for r in requests]
    assert any(s.stop_reason == "stop" for s in expected[3])  # some rows stop early
    assert any(len(s.tokens) < 10 for s in expected[3])
    results: dict[int, object] = {}
    later = [batched(r, results, i) for i, r in enumerate(requests)][2:]
    steps = 0

    def join():  # the last three arrive at steps 2, 4 and 6 of the first two's decode
        nonlocal steps
        steps += 1
        return [later.pop(0)] if later and steps % 2 == 0 else []

    first = [batched(r, results, i) for i, r in enumerate(requests[:2])]
    session.sample_many(LIVE_WEIGHTS, first, join)
    assert [results[i][0] for i in range(len(requests))] == expected
    assert list(results[2][1].logprobs) == session.prompt_logprobs(requests[2].prompt_tokens)


def test_each_samples_logprobs_are_the_trainers_forward_bit_for_bit(session):
    """Batching changes the decode only: the logprobs stay the exact per-sample recompute."""
    requests = mixed_requests(session.sampler.vocab_size)
    results: dict[int, object] = {}
    calls = [batched(r, results, i) for i, r in enumerate(requests)]
    session.sample_many(LIVE_WEIGHTS, calls)
    for index, request in enumerate(requests):
        for sample in results[index][0]:
            exact = session.sampler.logprobs(
                session.model, request.prompt_tokens, sample.tokens, session.device
            )
            assert sample.logprobs == exact


def test_a_refused_request_in_a_batch_is_refused_alone_with_todays_message(session):
    requests = mixed_requests(session.sampler.vocab_size)
    too_long = SampleRequest([5] * 10, max_tokens=4096, num_samples=64)
    with pytest.raises(InvalidArgument) as alone_error:
        alone(session, too_long)
    results: dict[int, object] = {}
    calls = [batched(r, results, i) for i, r in enumerate([requests[0], too_long, requests[1]])]
    session.sample_many(LIVE_WEIGHTS, calls)
    assert isinstance(results[1], InvalidArgument)
    assert str(results[1]) == str(alone_error.value)
    assert results[0][0] == alone(session, requests[0])
    assert results[2][0] == alone(session, requests[1])


def test_padding_never_lets_a_request_hold_more_kv_cache_than_its_limit():
    assert tile_rows_for(4, 100, 64 * 4096, 16) == 16
    assert tile_rows_for(1, 30000, 64 * 4096, 16) == 8  # 16 x 30000 would pass the bound
    assert tile_rows_for(63, 4100, 64 * 4096, 16) == 1  # 64 padded rows would pass it
    for rows, positions in ((1, 262144), (3, 87381), (64, 4096), (17, 15000)):
        size = tile_rows_for(rows, positions, 64 * 4096, 16)
        assert -(-rows // size) * size * positions <= 64 * 4096


# -- through the host ------------------------------------------------------------------------


def test_requests_waiting_together_decode_as_one_batch_each_as_it_would_alone(host, monkeypatch):
    requests = mixed_requests(host.session.sampler.vocab_size)
    expected = [host.apply(ops.SAMPLE, r) for r in requests]
    sizes = spy_batches(monkeypatch)
    started, release = held_executor(host, monkeypatch)
    with ThreadPoolExecutor(len(requests) + 1) as pool:
        held = pool.submit(host.apply, ops.TOKENIZE, TokenizeRequest(["x"]))
        assert started.wait(30)
        futures = [pool.submit(host.apply, ops.SAMPLE, r) for r in requests]
        wait_for(lambda: host.scheduler.waiting == len(requests) + 1)
        release.set()
        held.result(timeout=60)
        assert [f.result(timeout=120) for f in futures] == expected
    assert sizes == [len(requests)]


def test_a_refused_request_waiting_with_others_is_refused_before_any_work(host, monkeypatch):
    requests = mixed_requests(host.session.sampler.vocab_size)[:2]
    bad = SampleRequest([1, 2], max_tokens=0)
    with pytest.raises(InvalidArgument, match="max_tokens must be in") as refused_alone:
        host.apply(ops.SAMPLE, bad)
    expected = [host.apply(ops.SAMPLE, r) for r in requests]
    started, release = held_executor(host, monkeypatch)
    with ThreadPoolExecutor(4) as pool:
        held = pool.submit(host.apply, ops.TOKENIZE, TokenizeRequest(["x"]))
        assert started.wait(30)
        futures = [pool.submit(host.apply, ops.SAMPLE, r) for r in (requests[0], bad, requests[1])]
        wait_for(lambda: host.scheduler.waiting == 4)
        release.set()
        held.result(timeout=60)
        with pytest.raises(InvalidArgument) as refused:
            futures[1].result(timeout=60)
        assert str(refused.value) == str(refused_alone.value)
        assert [futures[0].result(timeout=60), futures[2].result(timeout=60)] == expected


def test_training_beside_concurrent_samples_keeps_its_order_and_bits(
    make_host, host_config, model_root, tmp_path
):
    plain = SessionHost(tmp_path / "plain", model_root=model_root, device="cpu")
    plain.recover()
    plain.open("run", host_config, 10, "sha256:plan")
    sampled = make_host()
    sampled.open("run", host_config, 10, "sha256:plan")
    try:
        expected = run_ops(plain, 0, 3)
        requests = mixed_requests(sampled.session.sampler.vocab_size)
        done = threading.Event()

        def keep_sampling() -> int:
            count = 0
            while not done.is_set():
                sampled.apply(ops.SAMPLE, requests[count % len(requests)])
                count += 1
            return count

        with ThreadPoolExecutor(3) as pool:
            samplers = [pool.submit(keep_sampling) for _ in range(2)]
            outcomes = run_ops(sampled, 0, 3)
            done.set()
            assert all(f.result(timeout=120) > 0 for f in samplers)
        assert outcomes == expected
        assert sampled.info().state_digest == plain.info().state_digest
    finally:
        plain.wait_idle()
        plain.release()


def test_with_batching_off_each_request_decodes_alone_whatever_waits_with_it(host, monkeypatch):
    """The mode for a device whose kernels are not batch invariant: one request a batch, all
    its rows in one forward (the decode before batching)."""
    requests = mixed_requests(host.session.sampler.vocab_size)[:3]
    monkeypatch.setattr(host.session.sampler, "batches", False)
    expected = [host.apply(ops.SAMPLE, r) for r in requests]
    sizes = spy_batches(monkeypatch)
    started, release = held_executor(host, monkeypatch)
    with ThreadPoolExecutor(len(requests) + 1) as pool:
        held = pool.submit(host.apply, ops.TOKENIZE, TokenizeRequest(["x"]))
        assert started.wait(30)
        futures = [pool.submit(host.apply, ops.SAMPLE, r) for r in requests]
        wait_for(lambda: host.scheduler.waiting == len(requests) + 1)
        release.set()
        held.result(timeout=60)
        assert [f.result(timeout=120) for f in futures] == expected
    assert sizes == [1, 1, 1]


def test_rows_that_end_leave_and_the_rest_repack_into_fewer_tiles_with_the_same_bits(
    session, monkeypatch
):
    vocab = session.sampler.vocab_size
    prompt = prompts(vocab)[1]
    half = range(3, vocab, 2)  # rows of both stop at their own steps
    requests = [  # two full tiles of one length
        SampleRequest(prompt, max_tokens=16, num_samples=8, seed=1, stop_tokens=half),
        SampleRequest(prompt, max_tokens=16, num_samples=8, seed=2, stop_tokens=half),
    ]
    expected = [alone(session, r) for r in requests]
    assert {len(s.tokens) for s in expected[0] + expected[1]} != {16}
    tiles_seen: list[int] = []
    step, gather = batch_decode.BatchDecoder.step, batch_decode._gather
    gathered: list[int] = []

    def counted(decoder):
        tiles_seen.append(len(decoder.tiles))
        step(decoder)

    def counted_gather(tiles, size, device):
        gathered.append(len(tiles))
        return gather(tiles, size, device)

    monkeypatch.setattr(batch_decode.BatchDecoder, "step", counted)
    monkeypatch.setattr(batch_decode, "_gather", counted_gather)
    monkeypatch.setattr(session.sampler, "tile_rows", 8)
    results: dict[int, object] = {}
    calls = [batched(r, results, i) for i, r in enumerate(requests)]
    session.sample_many(LIVE_WEIGHTS, calls)
    assert [results[0][0], results[1][0]] == expected
    assert gathered == [2]  # the live rows of both tiles, once they fit one
    assert tiles_seen[0] == 2 and tiles_seen[-1] == 1


def test_a_host_without_sample_batching_gives_its_sessions_samplers_that_decode_alone(
    make_host, host_config
):
    """``trainwire serve --no-sample-batching``: every session the host opens decodes each
    request alone (and the flag reaches the host)."""
    from trainwire.cli import build_parser

    args = build_parser().parse_args(["serve", "--listen", ":0", "--state-dir", "s"])
    assert args.no_sample_batching is False
    args = build_parser().parse_args(
        ["serve", "--listen", ":0", "--state-dir", "s", "--no-sample-batching"]
    )
    assert args.no_sample_batching is True
    host = make_host(sample_batching=False)
    host.open("run", host_config, 10, "sha256:plan")
    assert host.session.sampler.batches is False
