"""Samples of several LoRA runs on one shared base decoded as one batch (``together.sampling``):
the base once per step over every run's rows, each row under its own run's adapter, every sample
and every score the bits its run gives it alone.

Four runs on the tiny llama, each its own adapter trained a step on texts of its own, ask for
samples of other prompts, counts, max_tokens, temperatures, seeds, stop tokens and strings, top-k
sample logprobs and prompt scores. Their answers are pickled and compared byte for byte with
the same request decoded alone in its run, and within a batch of its run's requests only.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
from host_operations import BATCHES, op
from sample_requests import prompts
from test_runs_together import WITH_HEAD

from trainwire.client import LoraSettings
from trainwire.server.engine.sampling.sample_weights import LIVE_WEIGHTS
from trainwire.server.engine.sampling.sampler import BatchedSample
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.together import RowInvariance, row_invariance
from trainwire.server.engine.together import sampling as together
from trainwire.server.engine.together.row_blocks import head_adapter
from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import Cancelled, FailedPrecondition
from trainwire.server.service import operations as ops
from trainwire.server.service import reads, sample_batching
from trainwire.server.service.requests import (
    ForwardBackwardRequest,
    OptimStepRequest,
    SampleRequest,
)
from trainwire.testing import tiny_token_examples

ADAPTERS = {  # name: its run's LoRA and seed
    "a": (LoraSettings(r=4, alpha=8), 1),
    "b": (LoraSettings(r=8, alpha=16), 2),
    "c": (LoraSettings(r=2, alpha=4), 3),
    "d": (LoraSettings(r=4, alpha=16), 4),
}


def requests_of(run: int, vocab: int) -> list[SampleRequest]:
    """Run ``run``'s requests: prompts of lengths 3, 5, 5 and 9 (rows of one length share a
    stack), each run its own seeds, counts and settings."""
    first, second, third, fourth = prompts(vocab)
    early = tuple(range(3 + run, vocab, 4))
    return [
        SampleRequest(first, max_tokens=6 + run, num_samples=3, seed=10 * run, top_p=0.9),
        SampleRequest(
            second, max_tokens=5, num_samples=2 + run % 2, seed=10 * run + 1, temperature=0.7,
            topk_sample_logprobs=3,
        ),
        SampleRequest(
            third, max_tokens=8, num_samples=4, seed=10 * run + 2, top_k=20,
            prompt_logprobs=True, topk_prompt_logprobs=2,
        ),
        SampleRequest(fourth, max_tokens=7, num_samples=5, seed=10 * run + 3, stop_tokens=early),
        SampleRequest(second, max_tokens=4, seed=10 * run + 4, temperature=0, stop_strings=["a"]),
    ]  # fmt: skip


def batched(request: SampleRequest, results: dict[Any, object], key: Any) -> BatchedSample:
    def on_result(samples, scored):
        results[key] = pickle.dumps((samples, scored))  # every float's bits, NaN included

    def on_error(error):
        results[key] = error

    return BatchedSample(
        list(request.prompt_tokens),
        sample_batching.params_of(request),
        reads.prompt_scoring(request),
        on_result,
        on_error,
    )


def alone(session: TrainingSession, request: SampleRequest) -> bytes:
    results: dict[Any, object] = {}
    session.sample_many(LIVE_WEIGHTS, [batched(request, results, 0)])
    return results[0]


def within_its_run(session: TrainingSession, requests: list[SampleRequest]) -> list[bytes]:
    results: dict[Any, object] = {}
    session.sample_many(LIVE_WEIGHTS, [batched(r, results, i) for i, r in enumerate(requests)])
    return [results[i] for i in range(len(requests))]


@pytest.fixture
def base(llama_config) -> SharedBase:
    return SharedBase(llama_config(), device="cpu")


def trained_runs(base, llama_config, **lora: Any) -> dict[str, TrainingSession]:
    """Four runs on ``base`` (``ADAPTERS``, their settings replaced by ``lora``), each trained
    one step on tokens of its own (adapters differ)."""
    sessions = {}
    for index, (name, (settings, seed)) in enumerate(ADAPTERS.items()):
        settings = dataclasses.replace(settings, **lora)
        config = llama_config(lora=settings, seed=seed, lr_scheduler="constant", learning_rate=0.05)
        session = TrainingSession(config, device="cpu", base=base)
        session.forward_backward(tiny_token_examples(3, seed=index, min_length=4, max_length=9))
        session.optim_step()
        sessions[name] = session
    return sessions


@pytest.fixture
def runs(base, llama_config) -> dict[str, TrainingSession]:
    return trained_runs(base, llama_config)


@pytest.fixture
def stacks(monkeypatch) -> list[int]:
    """How many runs' tiles each decode forward held."""
    held: list[int] = []
    inner = together._forward

    def counted(stack):
        held.append(len({id(decoder) for decoder, _ in stack}))
        return inner(stack)

    monkeypatch.setattr(together, "_forward", counted)
    return held


@pytest.fixture
def scored_rows(monkeypatch) -> list[int]:
    """How many samples each stacked scoring forward held."""
    held: list[int] = []
    inner = together.final_hidden_states

    def counted(model, input_ids, attention_mask):
        held.append(input_ids.shape[0])
        return inner(model, input_ids, attention_mask)

    monkeypatch.setattr(together, "final_hidden_states", counted)
    return held


def decode_together(
    runs: dict[str, TrainingSession], invariance: RowInvariance, *, joining: bool
) -> dict[tuple[str, int], object]:
    """Every run's requests in one batch; with ``joining`` runs c and d's join at steps 2 and
    3, one request a step (so rows of other lengths decode beside the first ones)."""
    vocab = runs["a"].sampler.vocab_size
    results: dict[Any, object] = {}
    pairs = [
        (runs[name], batched(request, results, (name, index)))
        for run, name in enumerate(runs)
        for index, request in enumerate(requests_of(run, vocab))
    ]
    first = [p for p in pairs if not joining or p[0] in (runs["a"], runs["b"])]
    later = [p for p in pairs if p not in first]
    steps = 0

    def join():
        nonlocal steps
        steps += 1
        return [later.pop(0)] if later and steps >= 2 else []

    together.sample_together(first, join, invariance)
    assert not later
    return results


def expected(runs: dict[str, TrainingSession]) -> dict[tuple[str, int], bytes]:
    vocab = runs["a"].sampler.vocab_size
    out = {}
    for run, (name, session) in enumerate(runs.items()):
        requests = requests_of(run, vocab)
        own_batch = within_its_run(session, requests)
        for index, request in enumerate(requests):
            out[(name, index)] = alone(session, request)
            assert own_batch[index] == out[(name, index)]
    return out


@pytest.mark.parametrize("joining", [False, True])
def test_runs_samples_decode_as_one_batch_each_the_bits_of_its_run_alone(
    runs, stacks, scored_rows, joining
):
    want = expected(runs)
    samples = [pickle.loads(value)[0] for value in want.values()]
    assert any(s.stop_reason == "stop" for batch in samples for s in batch)  # rows end early
    assert len({value for value in want.values()}) == len(want)  # no two answers alike
    invariance = row_invariance(runs["a"].model)
    assert invariance.min_rows is not None and invariance.min_rows <= 8  # this CPU, 1 thread
    got = decode_together(runs, invariance, joining=joining)
    assert got == want
    # Together from the start, a forward holds every run's rows; joining at later steps, rows
    # stack with those of their own length only, still of several runs.
    assert max(stacks) >= 2 if joining else max(stacks) == len(runs)
    assert max(scored_rows) >= 2  # samples of one length scored in one forward


def test_runs_with_head_adapters_decode_as_one_batch_each_the_bits_of_its_run_alone(
    base, llama_config, stacks
):
    """Every run's head carries an adapter (as the Tinker SDK's runs do by default): each
    tile's rows get the base's head among every tile's rows and their own run's adapter."""
    runs = trained_runs(base, llama_config, target_modules=WITH_HEAD)
    want = expected(runs)
    assert len({value for value in want.values()}) == len(want)  # no two answers alike
    vocab = runs["a"].sampler.vocab_size
    request = requests_of(0, vocab)[0]
    # A row under another run's head adapter (its body's too) would differ.
    assert len({alone(session, request) for session in runs.values()}) == len(runs)
    assert decode_together(runs, row_invariance(runs["a"].model), joining=False) == want
    assert max(stacks) == len(runs)


@pytest.mark.parametrize("with_head", [("b", "d"), ("a", "c")])
def test_runs_with_and_without_head_adapters_decode_as_one_batch_each_as_alone(
    base, llama_config, stacks, with_head
):
    """Some runs' heads carry an adapter, others' do not (the first run's either way): each
    tile's rows get the base's head among every tile's rows, and their own run's head adapter
    where it has one."""
    runs = trained_runs(base, llama_config)
    headed = trained_runs(base, llama_config, target_modules=WITH_HEAD)
    mixed = {name: headed[name] if name in with_head else runs[name] for name in runs}
    carries = {name for name, session in mixed.items() if head_adapter(session.model)}
    assert carries == set(with_head)
    assert together.sessions_problem(list(mixed.values())) is None
    want = expected(mixed)
    assert len(set(want.values())) == len(want)  # no two answers alike
    assert decode_together(mixed, row_invariance(mixed["a"].model), joining=False) == want
    assert max(stacks) == len(mixed)


def test_adapters_differ_so_a_row_under_another_runs_adapter_would_differ(runs):
    vocab = runs["a"].sampler.vocab_size
    request = requests_of(0, vocab)[0]
    assert len({alone(session, request) for session in runs.values()}) == len(runs)


def test_where_the_device_gives_rows_other_bits_stacked_every_tile_runs_alone(
    runs, stacks, scored_rows
):
    found = row_invariance(runs["a"].model)
    never = RowInvariance("cpu", found.dtype, None, found.max_rows, found.head_rows)
    fewer = RowInvariance("cpu", found.dtype, 9, found.max_rows, found.head_rows)
    vocab = runs["a"].sampler.vocab_size
    request = sample_batching.params_of(requests_of(0, vocab)[0])
    assert "gives a linear layer's rows other bits" in together.request_problem(
        runs["a"], 3, request, never
    )
    assert "a request of 8 positions is under the 9" in together.request_problem(
        runs["a"], 3, request, fewer
    )
    want = expected(runs)
    # Scoring is one row of 8 positions or more a sample: some stack from 9 up, none ever.
    for invariance, scores_stack in ((never, False), (fewer, True)):
        stacks.clear()
        scored_rows.clear()
        assert decode_together(runs, invariance, joining=True) == want
        assert stacks and max(stacks) == 1  # tiles of 8 rows and 1 position: each alone
        assert bool(scored_rows) == scores_stack


def test_a_stack_never_holds_more_positions_than_the_probe_covered(runs, stacks):
    found = row_invariance(runs["a"].model)
    small = dataclasses.replace(found, max_rows=17, head_rows=17)  # two tiles of 8 at most
    assert decode_together(runs, small, joining=False) == expected(runs)
    assert max(stacks) == 2


@pytest.mark.parametrize(
    "other, reason",
    [
        ({"lora": LoraSettings(r=4, alpha=8, use_dora=True)}, "session 1: DoRA adapters run alone"),
        (
            {"lora": LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))},
            "session 1: its LoRA layers are on other modules than session 0's",
        ),
        (None, "session 1: it runs on another base than session 0"),
    ],
)
def test_runs_that_cannot_share_a_forward_are_refused_with_why(
    runs, base, llama_config, other, reason
):
    if other is None:
        session = TrainingSession(llama_config(lora=LoraSettings(r=4, alpha=8)), device="cpu")
    else:
        session = TrainingSession(llama_config(**other), device="cpu", base=base)
    pair = [runs["a"], session]
    assert together.sessions_problem(pair) == reason
    results: dict[Any, object] = {}
    request = requests_of(0, runs["a"].sampler.vocab_size)[0]
    invariance = row_invariance(runs["a"].model)
    with pytest.raises(FailedPrecondition, match=f"cannot decode together: {reason}"):
        together.sample_together(
            [(s, batched(request, results, i)) for i, s in enumerate(pair)], list, invariance
        )
    assert not results  # refused before anything ran
    # A run that cannot join an open batch is refused alone; the batch decodes on.
    first = [(runs["a"], batched(request, results, "a"))]
    late = [(session, batched(request, results, "late"))]
    together.sample_together(first, lambda: [late.pop()] if late else [], invariance)
    assert results["a"] == alone(runs["a"], request)
    assert isinstance(results["late"], FailedPrecondition) and reason in str(results["late"])


def test_the_service_decodes_several_runs_samples_as_one_batch_and_says_why_not(
    make_host, llama_config, stacks
):
    host = make_host(max_runs=3)
    for index, (name, (lora, seed)) in enumerate(list(ADAPTERS.items())[:3]):
        host.open(name, llama_config(lora=lora, seed=seed, lr_scheduler="constant"))
        request = ForwardBackwardRequest(BATCHES[index])
        host.apply(ops.FORWARD_BACKWARD, request, op(f"{name}0", 0), run_id=name)
        host.apply(ops.OPTIM_STEP, OptimStepRequest(), op(f"{name}1", 1), run_id=name)
    active = {name: host._runs[name] for name in ("a", "b", "c")}
    vocab = active["a"].session.sampler.vocab_size
    requests = {name: requests_of(run, vocab)[:3] for run, name in enumerate(active)}
    prepared = {
        (name, i): sample_batching.PreparedSample.of(active[name], request)
        for name in active
        for i, request in enumerate(requests[name])
    }
    first = prepared[("a", 0)]
    assert all(sample_batching.together_problem(first, p) is None for p in prepared.values())
    export = sample_batching.PreparedSample.of(
        active["b"], dataclasses.replace(requests["b"][0], base_model=True)
    )
    assert sample_batching.together_problem(first, export) == (
        "it reads an export or the base model, not its run's live weights"
    )
    own_base = sample_batching.PreparedSample.of(
        active["a"], dataclasses.replace(requests["a"][1], base_model=True)
    )
    assert sample_batching.together_problem(first, own_base) == (
        "it reads other weights than the batch's first request"
    )

    batch = [prepared[("a", 0)], prepared[("b", 0)]]
    later = [p for key, p in prepared.items() if key not in {("a", 0), ("b", 0)}]
    sample_batching.decode_batch(batch, lambda: [later.pop(0) for _ in range(len(later))])
    for (name, index), sample in prepared.items():
        request = requests[name][index]
        want = reads.sample(active[name], request, None)
        assert pickle.dumps(sample.answer.result()) == pickle.dumps(want)
    assert max(stacks) == 3
    # Run c decoding in tiles of 2 rows: each step's 2 positions are too few on this CPU.
    active["c"].session.sampler.tile_rows = 2
    found = row_invariance(active["a"].session.model)
    assert f"a request of 2 positions is under the {found.min_rows}" in (
        sample_batching.together_problem(first, prepared[("c", 0)]) or ""
    )


def test_a_request_joins_only_within_its_kv_bound_counting_every_runs_rows(runs, monkeypatch):
    """Bounds of 100 positions: each request's tile holds 8 x 11, so no two run at once."""
    for session in runs.values():
        session.sampler.limits = dataclasses.replace(
            session.sampler.limits, max_sample_positions=100
        )
    prompt = prompts(runs["a"].sampler.vocab_size)[1]
    requests = {
        name: SampleRequest(prompt, max_tokens=6, num_samples=4, seed=run)
        for run, name in enumerate(runs)
    }
    want = {name: alone(runs[name], request) for name, request in requests.items()}
    busy: list[int] = []
    inner = together._Stacked.step

    def counted(stacked):
        busy.append(sum(decoder.busy for decoder in stacked.decoders))
        inner(stacked)

    monkeypatch.setattr(together._Stacked, "step", counted)
    results: dict[Any, object] = {}
    pairs = [(runs[n], batched(r, results, n)) for n, r in requests.items()]
    together.sample_together(pairs, list, row_invariance(runs["a"].model))
    assert results == want
    assert max(busy) == 1 and len(busy) == 6 * len(runs)  # one run's rows at a time


def test_a_request_whose_caller_gave_up_leaves_and_the_others_keep_their_bits(runs):
    vocab = runs["a"].sampler.vocab_size
    requests = {name: requests_of(run, vocab)[3] for run, name in enumerate(runs)}
    want = {name: alone(runs[name], request) for name, request in requests.items()}
    results: dict[Any, object] = {}
    polled = 0

    def gave_up() -> bool:  # polled once a step: true from the third step on
        nonlocal polled
        polled += 1
        return polled >= 3

    pairs = [(runs[n], batched(r, results, n)) for n, r in requests.items()]
    pairs[1] = (pairs[1][0], dataclasses.replace(pairs[1][1], cancelled=gave_up))
    together.sample_together(pairs, list, row_invariance(runs["a"].model))
    assert isinstance(results.pop("b"), Cancelled)
    assert results == {name: value for name, value in want.items() if name != "b"}
