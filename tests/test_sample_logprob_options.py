"""The sampler's logprob options in the engine: the top k of each sampled and prompt position,
the prompt's last n positions, and the logprobs of ids a request names. Every value is the one
``forward`` gives for that id as the target at that position, bit for bit; the top k is taken per
chunk of positions (never ``[tokens x vocabulary]`` at once); and requests asking for different
options decode as one batch, each getting what it gets alone."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import pytest
import torch
from test_chunked_logprobs import CHUNK, CHUNK_BYTES, VOCAB, LargestVocabularyRows

from trainwire.client import LoraSettings, TokenExample
from trainwire.server.engine.sampling.params import PromptScoring, SamplingLimits
from trainwire.server.engine.sampling.sample_weights import LIVE_WEIGHTS
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.server.service import reads, sample_batching
from trainwire.server.service.requests import SampleRequest
from trainwire.server.tinker import sample_codec

K = 4


def make_session(llama_config, setup: str) -> TrainingSession:
    """Chunks of 3 positions: every prompt and sample here spans several."""
    lora = LoraSettings(r=4, alpha=8, dropout=0.0) if setup == "lora" else None
    config = llama_config(lora=lora, lr_scheduler="constant")
    return TrainingSession(config, device="cpu", logits_chunk_bytes=CHUNK_BYTES)


def forward_values(session: TrainingSession, tokens: Sequence[int], targets: Sequence[int]):
    """What ``forward`` gives for ``targets`` after the prefixes of ``tokens``, alone."""
    return session.forward([TokenExample(tuple(tokens), tuple(targets))]).logprobs[0]


def plain_log_softmax(session: TrainingSession, tokens: Sequence[int]) -> torch.Tensor:
    """The whole fp32 log-softmax of every position, unchunked (ids only: its last bits are
    another blocking's)."""
    with torch.no_grad():
        logits = session.model(input_ids=torch.tensor([list(tokens)])).logits[0].float()
    return torch.log_softmax(logits, -1)


def check_top_rows(forward, tokens, targets, rows, first: int) -> None:
    """``rows[i]``, the top k at example position ``first + i``: k ids, best first, each valued
    bit for bit as ``forward(tokens, targets)`` (the trainer's) values it as the target there."""
    for rank in range(len(rows[0])):
        swapped = list(targets)
        for offset, row in enumerate(rows):
            swapped[first + offset] = row[rank][0]
        values = forward(tokens, swapped)
        for offset, row in enumerate(rows):
            assert row[rank] == (swapped[first + offset], values[first + offset])
    for row in rows:
        assert [value for _, value in row] == sorted((value for _, value in row), reverse=True)


def check_plain_top_ids(session: TrainingSession, tokens, rows, first: int) -> None:
    """The ids of ``rows`` are the plain log-softmax's top k there."""
    top_ids = plain_log_softmax(session, tokens).topk(K, -1).indices.tolist()
    assert [[token for token, _ in row] for row in rows] == top_ids[first : first + len(rows)]


@pytest.mark.parametrize(("setup", "temperature"), [("full", 1.0), ("lora", 0.0)])
def test_each_sampled_positions_top_k_is_forwards_value_for_those_ids(
    llama_config, setup, temperature
):
    session = make_session(llama_config, setup)
    prompt = session.tokenize(["the movie was"])[0]
    samples = session.sample(
        prompt, max_tokens=7, num_samples=2, seed=3, temperature=temperature, topk_sample_logprobs=K
    )
    for sample in samples:
        rows = sample.topk_logprobs.rows()
        assert len(rows) == len(sample.tokens)
        full = [*prompt, *sample.tokens]
        forward = functools.partial(forward_values, session)
        check_top_rows(forward, full[:-1], full[1:], rows, len(prompt) - 1)
        check_plain_top_ids(session, full[:-1], rows, len(prompt) - 1)
        if temperature == 0:  # greedy: the best id is the token drawn, with its own logprob
            tops = [row[0] for row in rows]
            assert tops == list(zip(sample.tokens, sample.logprobs, strict=True))


@pytest.mark.parametrize("setup", ["full", "lora"])
def test_the_prompts_top_k_last_n_and_targets_are_forwards_values(llama_config, setup):
    session = make_session(llama_config, setup)
    prompt = session.tokenize(["the cat sat on the mat and then"])[0]
    length = len(prompt)
    assert length > 3 * CHUNK  # the last n start inside a later chunk
    last_n = length - 2 * CHUNK - 2
    targets = [[-1, -1]] * 4 + [[(7 * i) % VOCAB, -1 if i % 3 else 11] for i in range(length - 5)]
    scoring = PromptScoring(True, K, last_n, tuple(tuple(row) for row in targets))
    scored = session.prompt_scores(prompt, scoring)
    plain = session.prompt_logprobs(prompt)
    first = length - last_n
    assert all(math.isnan(v) for v in scored.logprobs[:first])
    assert scored.logprobs[first:] == tuple(plain[first:])
    assert scored.first == first and len(scored.topk) == last_n
    forward = functools.partial(forward_values, session)
    check_top_rows(forward, prompt[:-1], prompt[1:], scored.topk.rows(), first - 1)
    check_plain_top_ids(session, prompt[:-1], scored.topk.rows(), first - 1)
    for column in range(2):
        named = [
            row[column] if row[column] >= 0 else prompt[i + 1] for i, row in enumerate(targets)
        ]
        values = forward_values(session, prompt[:-1], named)
        expected = [values[i] if row[column] >= 0 else None for i, row in enumerate(targets)]
        assert [row[column] for row in scored.targets] == expected


def test_top_k_never_holds_logits_for_every_position(llama_config):
    session = TrainingSession(
        llama_config(max_length=256), device="cpu", logits_chunk_bytes=CHUNK_BYTES
    )
    prompt = [3 + (5 * i) % (VOCAB - 3) for i in range(200)]
    targets = tuple((i % VOCAB, -1) for i in range(199))
    for call in (
        lambda: session.prompt_scores(prompt, PromptScoring(True, K, None, targets)),
        lambda: session.sample(prompt, max_tokens=20, seed=1, topk_sample_logprobs=K),
    ):
        with LargestVocabularyRows(VOCAB) as seen:
            call()
        assert seen.rows <= max(CHUNK, session.model.config.hidden_size) < 100, seen.rows


def options_requests(prompt: list[int]) -> list[SampleRequest]:
    """One prompt and seed, other logprob options: the same draws, other reports."""
    targets = tuple((prompt[i + 1], -1) for i in range(len(prompt) - 1))
    return [
        SampleRequest(prompt, max_tokens=6, num_samples=2, seed=9),
        SampleRequest(prompt, max_tokens=6, num_samples=2, seed=9, topk_sample_logprobs=K),
        SampleRequest(
            prompt,
            max_tokens=6,
            num_samples=2,
            seed=9,
            prompt_logprobs=True,
            topk_prompt_logprobs=2,
            prompt_logprobs_last_n=2,
        ),
        SampleRequest(prompt, max_tokens=6, num_samples=2, seed=9, target_prompt_logprobs=targets),
        SampleRequest(prompt[:3], max_tokens=4, seed=2, topk_sample_logprobs=1),
    ]


def alone(session: TrainingSession, request: SampleRequest) -> reads.SampleResult:
    topk = request.topk_sample_logprobs
    samples = session.sample(
        request.prompt_tokens, topk_sample_logprobs=topk, **request.sampling_settings()
    )
    scoring = reads.prompt_scoring(request)
    scored = session.prompt_scores(request.prompt_tokens, scoring) if scoring.asked else None
    return reads.SampleResult(samples, scored)


def test_requests_asking_other_logprobs_decode_together_each_as_alone(llama_config):
    session = make_session(llama_config, "full")
    prompt = session.tokenize(["a dog ran in the park"])[0]
    requests = options_requests(prompt)
    expected = [bits(alone(session, r)) for r in requests]
    assert len({tuple(s.tokens for s in e[0]) for e in expected[:4]}) == 1  # the same draws
    results: dict[int, object] = {}

    def batched(index: int, request: SampleRequest) -> BatchedSample:
        def on_result(samples, scored):
            results[index] = bits(reads.SampleResult(samples, scored))

        def on_error(error):
            results[index] = error

        params = sample_batching.params_of(request)
        scoring = reads.prompt_scoring(request)
        return BatchedSample(list(request.prompt_tokens), params, scoring, on_result, on_error)

    session.sample_many(LIVE_WEIGHTS, [batched(i, r) for i, r in enumerate(requests)])
    assert [results[i] for i in range(len(requests))] == expected


def bits(result: reads.SampleResult) -> tuple:
    """A result with its NaNs comparable."""
    scored = result.prompt_logprobs
    logprobs = None if scored is None or scored.logprobs is None else str(scored.logprobs)
    rest = None if scored is None else (scored.topk, scored.targets)
    return result.samples, logprobs, rest


def test_the_fronts_logprob_bound_is_the_engines() -> None:
    """The Tinker codec bounds the options before it logs a request (it imports no engine)."""
    assert SamplingLimits().max_logprob_ids == sample_codec.MAX_LOGPROB_IDS


@pytest.mark.parametrize(
    ("scoring", "message"),
    [
        (PromptScoring(True, 21), "topk_prompt_logprobs must be in [0, 20], got 21"),
        (PromptScoring(True, 0, 0), "prompt_logprobs_last_n must be in [1, 4]"),
        (PromptScoring(True, 0, 5), "prompt_logprobs_last_n must be in [1, 4]"),
        (PromptScoring(False, 2, 2), "prompt_logprobs_last_n needs prompt_logprobs"),
        (PromptScoring(targets=((1,),) * 3), "must have 4 rows"),
        (PromptScoring(targets=((-1,),) * 4), "names no id"),
        (PromptScoring(targets=((VOCAB,),) * 4), f"ids in [0, {VOCAB}) or -1"),
        (PromptScoring(targets=((1,) * 21,) * 4), "rows must hold 1 to 20 ids, got 21"),
    ],
)
def test_a_bad_option_is_refused_by_name_before_any_work(llama_config, scoring, message):
    session = TrainingSession(llama_config(lr_scheduler="constant"), device="cpu")
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        session.prompt_scores([5, 6, 7, 8, 9], scoring)
    with pytest.raises(InvalidArgument, match=r"topk_sample_logprobs must be in \[0, 20\]"):
        session.sample([5, 6], max_tokens=2, topk_sample_logprobs=21)
