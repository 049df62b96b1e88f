"""LoRA runs on one shared base computed in one pass (``engine.together``): every bit as alone.

Each run is a list of steps; a step is one or more forward_backward requests (two accumulate
before one update) followed by its own ``optim_step``, then a ``forward``. The same runs go once
each alone, on a base of its own, and once together: every request of a step in one pass with
the other runs' requests of that step. Every result (losses, logprobs, metrics) and every digest
after every step (pending gradients and accumulation counters included) compare exactly.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fresh_state import fresh_digest

from trainwire.client import InputExample, LoraSettings, TrainingConfig
from trainwire.contract.tokens import DEFAULT_LOSS
from trainwire.server.engine.loss.chunked_logprobs import LOGITS_CHUNK_BYTES
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.together import (
    Request,
    RowInvariance,
    compatible,
    group_together,
    row_invariance,
    run_together,
)
from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import FailedPrecondition
from trainwire.testing import tiny_token_examples

WIDTH = 11  # every request of these runs pads to it: only batches of one width run together
LONGEST = InputExample("a dull film with no story")  # 11 tokens with its EOS


def _tokens(count: int, seed: int) -> list:
    """``count`` token examples of unequal lengths whose longest is ``WIDTH``."""
    examples = tiny_token_examples(count - 1, seed=seed, min_length=4, max_length=WIDTH - 1)
    return [*examples, *tiny_token_examples(1, seed=seed + 100, min_length=WIDTH, max_length=WIDTH)]


def _texts(count: int, seed: int) -> list[InputExample]:
    shorter = [
        InputExample("the movie", completion=" was great"),
        InputExample("what a fine day"),
        InputExample(f"count {seed} and {seed + 1}"),
    ]
    return [LONGEST, *shorter[: count - 1]]


# name: (config overrides, one step's requests: (examples, loss_fn) of each forward_backward)
RUNS: dict[str, tuple[dict[str, Any], Callable[[int], list[tuple[list, str]]]]] = {
    "cross_entropy": (
        {"seed": 1, "lora": LoraSettings(r=4, alpha=8)},
        lambda step: [(_tokens(2, step), "cross_entropy")],
    ),
    "importance_sampling": (
        {"seed": 2, "lora": LoraSettings(r=8, alpha=16)},
        lambda step: [
            (_tokens(3, 10 + step), "importance_sampling"),
            (_tokens(2, 20 + step), "importance_sampling"),  # accumulates before the update
        ],
    ),
    "ppo": (
        {"seed": 3, "lora": LoraSettings(r=4, alpha=16)},
        lambda step: [(_tokens(4, 30 + step), "ppo")],
    ),
    "text": (
        {"seed": 4, "lora": LoraSettings(r=2, alpha=4)},
        lambda step: [(_texts(2 + step % 2, step), DEFAULT_LOSS)],
    ),
}
STEPS = 3


@pytest.fixture
def run_config(llama_config) -> Callable[..., TrainingConfig]:
    return lambda name, **extra: llama_config(lr_scheduler="constant", **RUNS[name][0], **extra)


@pytest.fixture
def base(llama_config) -> SharedBase:
    return SharedBase(llama_config(), device="cpu")


Steps = Callable[[int], list[tuple[list, str]]]


def _alone(session: TrainingSession, name: str, runs: dict[str, tuple[Any, Steps]] = RUNS):
    out = []
    for step in range(STEPS):
        for examples, loss_fn in runs[name][1](step):
            out.append(session.forward_backward(examples, loss_fn=loss_fn))
        out.append(fresh_digest(session))
        out.append(session.optim_step())
        examples, loss_fn = runs[name][1](step)[0]
        out.append(session.forward(examples, loss_fn=loss_fn))
        out.append(fresh_digest(session))
    return out


def _together(
    sessions: dict[str, TrainingSession], runs: dict[str, tuple[Any, Steps]] = RUNS
) -> dict[str, list[Any]]:
    """The same steps, each round of requests of every run in one pass."""
    out: dict[str, list[Any]] = {name: [] for name in sessions}
    invariance = row_invariance(next(iter(sessions.values())).model)
    for step in range(STEPS):
        requests = {name: runs[name][1](step) for name in sessions}
        for round_ in range(max(map(len, requests.values()))):
            ready = [name for name in sessions if round_ < len(requests[name])]
            batch = [Request(sessions[n], *requests[n][round_]) for n in ready]
            assert compatible(batch, invariance) is None
            for name, result in zip(ready, run_together(batch, invariance), strict=True):
                out[name].append(result)
        for name, session in sessions.items():
            out[name].append(fresh_digest(session))
            out[name].append(session.optim_step())
        forwards = [Request(sessions[n], *requests[n][0]) for n in sessions]
        for name, result in zip(
            sessions, run_together(forwards, invariance, backward=False), strict=True
        ):
            out[name].append(result)
            out[name].append(fresh_digest(sessions[name]))
    return out


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_runs_together_give_every_bit_they_give_alone(base, run_config, gradient_checkpointing):
    settings = {"gradient_checkpointing": gradient_checkpointing}
    expected = {
        name: _alone(TrainingSession(run_config(name, **settings), device="cpu"), name)
        for name in RUNS
    }
    together = {
        name: TrainingSession(run_config(name, **settings), device="cpu", base=base)
        for name in RUNS
    }
    assert _together(together) == expected
    assert len({digests[-1] for digests in expected.values()}) == len(RUNS)  # runs differ


def test_two_runs_together_equal_alone_with_either_one_leading(base, run_config):
    """The pass runs the first request's module tree: either order gives the same bits."""
    first, second = "ppo", "cross_entropy"
    names = (first, second)
    expected = {
        name: _alone(TrainingSession(run_config(name), device="cpu"), name) for name in names
    }
    for order in (names, names[::-1]):
        sessions = {
            name: TrainingSession(run_config(name), device="cpu", base=base) for name in order
        }
        assert _together(sessions) == {name: expected[name] for name in order}


# The llama's linear layers and its output head: the LoRA targets the Tinker front makes of
# train_attn, train_mlp and train_unembed (its default).
WITH_HEAD = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
LONG_WIDTH = 40  # rows from 12 positions up: a chunk of them shares the head's product
SHORTEST = 12


def _long_tokens(count: int, seed: int) -> list:
    """``count`` token examples of 12 to 16 positions but the last, of ``LONG_WIDTH``."""
    examples = tiny_token_examples(count - 1, seed=seed, min_length=SHORTEST, max_length=16)
    last = tiny_token_examples(1, seed=seed + 100, min_length=LONG_WIDTH, max_length=LONG_WIDTH)
    return [*examples, *last]


# Three runs train an adapter on the head (other seeds, ranks and losses), one leaves it to the
# base: each chunk of the head's stacks is under its own run's head.
HEAD_RUNS: dict[str, tuple[dict[str, Any], Steps]] = {
    "head_cross_entropy": (
        {"seed": 5, "lora": LoraSettings(r=4, alpha=8, target_modules=WITH_HEAD)},
        lambda step: [(_long_tokens(2, 40 + step), "cross_entropy")],
    ),
    "head_importance_sampling": (
        {"seed": 6, "lora": LoraSettings(r=8, alpha=16, target_modules=WITH_HEAD)},
        lambda step: [
            (_long_tokens(3, 50 + step), "importance_sampling"),
            (_long_tokens(2, 60 + step), "importance_sampling"),  # accumulates
        ],
    ),
    "head_ppo": (
        {"seed": 7, "lora": LoraSettings(r=2, alpha=4, target_modules=WITH_HEAD)},
        lambda step: [(_long_tokens(1, 70 + step), "ppo")],
    ),
    "no_head": (
        {"seed": 8, "lora": LoraSettings(r=4, alpha=8)},
        lambda step: [(_long_tokens(2, 80 + step), "cross_entropy")],
    ),
}
# Positions of one chunk of the head's logits: the tiny llama's 500-entry vocabulary in fp32.
CHUNK_BUDGETS = {"one chunk": LOGITS_CHUNK_BYTES, "32 positions": 32 * 500 * 4}


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
@pytest.mark.parametrize("budget", list(CHUNK_BUDGETS))
def test_runs_with_head_adapters_together_give_every_bit_they_give_alone(
    base, llama_config, gradient_checkpointing, budget
):
    """The head's stacks hold chunks of several runs (rows of 12 to 16 positions share one;
    with 32 positions a chunk, the 40-position rows are cut into 32 and 8, the 8 run alone);
    alone a run takes the one-chunk path (head row by row) or the chunked one. Each head
    adapter's gradients, pending after a forward_backward, come from its own rows only."""

    def session(name: str, on: SharedBase | None) -> TrainingSession:
        config = llama_config(
            lr_scheduler="constant",
            gradient_checkpointing=gradient_checkpointing,
            max_length=64,
            **HEAD_RUNS[name][0],
        )
        return TrainingSession(
            config, device="cpu", base=on, logits_chunk_bytes=CHUNK_BUDGETS[budget]
        )

    expected = {name: _alone(session(name, None), name, HEAD_RUNS) for name in HEAD_RUNS}
    together = {name: session(name, base) for name in HEAD_RUNS}
    assert row_invariance(together["head_ppo"].model).min_rows <= SHORTEST  # chunks stack
    assert _together(together, HEAD_RUNS) == expected
    assert len({digests[-1] for digests in expected.values()}) == len(HEAD_RUNS)


def test_a_head_adapter_gets_the_gradient_of_its_own_rows_only(base, llama_config):
    """After one shared forward_backward, each run's head adapter holds exactly the gradient
    its own request leaves alone, and a run beside it changes nothing of it. (A first step,
    each alone, moves lora_B off its zeros: lora_A's gradient is zero before.)"""
    names = ("head_cross_entropy", "head_ppo")
    requests = {name: HEAD_RUNS[name][1](1)[0] for name in names}

    def head_gradients(session: TrainingSession) -> list[torch.Tensor]:
        head = session.model.get_output_embeddings()
        return [head.lora_A["default"].weight.grad, head.lora_B["default"].weight.grad]

    def session(name: str, on: SharedBase | None) -> TrainingSession:
        config = llama_config(lr_scheduler="constant", max_length=64, **HEAD_RUNS[name][0])
        started = TrainingSession(config, device="cpu", base=on)
        examples, loss_fn = HEAD_RUNS[name][1](0)[0]
        started.forward_backward(examples, loss_fn=loss_fn)
        started.optim_step()
        return started

    alone = {}
    for name in names:
        own = session(name, None)
        own.forward_backward(requests[name][0], loss_fn=requests[name][1])
        alone[name] = head_gradients(own)
    sessions = {name: session(name, base) for name in names}
    batch = [Request(sessions[name], *requests[name]) for name in names]
    run_together(batch, row_invariance(sessions[names[0]].model))
    for name in names:
        together = head_gradients(sessions[name])
        assert all(torch.equal(a, b) for a, b in zip(together, alone[name], strict=True))
        assert all(gradient.abs().sum() > 0 for gradient in together)


Build = Callable[[SharedBase, Callable[..., TrainingSession]], list[Request]]


def _beside_ppo(**config: Any) -> Build:
    """A ppo request, and a token request of a session with ``config`` on the same base."""

    def build(base: SharedBase, session: Callable[..., TrainingSession]) -> list[Request]:
        first = Request(session(base, **RUNS["ppo"][0]), _tokens(2, 0), "ppo")
        return [first, Request(session(base, **config), _tokens(3, 1))]

    return build


def _one_session_twice(base, session) -> list[Request]:
    twice = session(base, **RUNS["ppo"][0])
    return [Request(twice, _tokens(2, 0), "ppo"), Request(twice, _tokens(2, 1), "ppo")]


def _other_widths(base, session) -> list[Request]:
    wider = tiny_token_examples(1, seed=7, min_length=WIDTH + 1, max_length=WIDTH + 1)
    return [
        Request(session(base, **RUNS["ppo"][0]), _tokens(2, 0), "ppo"),
        Request(session(base, **RUNS["text"][0]), wider),
    ]


def _first_alone(base, session) -> list[Request]:
    return [
        Request(session(None, **RUNS["ppo"][0]), _tokens(2, 0), "ppo"),
        Request(session(base, **RUNS["text"][0]), _tokens(2, 1)),
    ]


def _other_base(base, session) -> list[Request]:
    other = SharedBase(base.config, device="cpu")
    return [
        Request(session(base, **RUNS["ppo"][0]), _tokens(2, 0), "ppo"),
        Request(session(other, **RUNS["text"][0]), _tokens(2, 1)),
    ]


LORA = LoraSettings(r=4, alpha=8)
REFUSED: dict[str, tuple[Build, str]] = {
    "dropout": (
        _beside_ppo(lora=LoraSettings(r=4, alpha=8, dropout=0.1)),
        "session 1: LoRA dropout 0.1 draws",
    ),
    "targets": (
        _beside_ppo(lora=LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))),
        "session 1: its LoRA layers are on other modules than session 0's",
    ),
    "checkpointing": (
        _beside_ppo(lora=LORA, gradient_checkpointing=True),
        "session 1: gradient_checkpointing differs",
    ),
    "dora": (
        _beside_ppo(lora=LoraSettings(r=4, alpha=8, use_dora=True)),
        "session 1: DoRA adapters run alone",
    ),
    "widths": (_other_widths, r"padded widths differ \(11, 12\)"),
    "twice": (_one_session_twice, "a session has two requests"),
    "own base": (_first_alone, "session 0 runs on a base of its own"),
    "other base": (_other_base, "session 1: it runs on another base than session 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_requests_that_cannot_run_together_are_refused_with_why_and_change_nothing(
    base, llama_config, case
):
    build, reason = REFUSED[case]

    def session(on: SharedBase | None, **config: Any) -> TrainingSession:
        return TrainingSession(
            llama_config(lr_scheduler="constant", **config), device="cpu", base=on
        )

    requests = build(base, session)
    invariance = row_invariance(requests[-1].session.model)
    assert re.search(reason, compatible(requests, invariance) or "")
    before = [fresh_digest(request.session) for request in requests]
    with pytest.raises(FailedPrecondition, match=f"cannot run together: {reason}"):
        run_together(requests, invariance)
    assert [fresh_digest(request.session) for request in requests] == before


def test_a_device_decides_from_how_many_rows_runs_share_a_product(base, run_config):
    """Requests of 2 x 11 and 3 x 11 positions, against what a probe might have found."""
    sessions = [
        TrainingSession(run_config(name), device="cpu", base=base) for name in ("ppo", "text")
    ]
    requests = [Request(sessions[0], _tokens(2, 0), "ppo"), Request(sessions[1], _tokens(3, 1))]
    found = row_invariance(sessions[0].model)
    assert found.min_rows is not None and found.min_rows <= 22  # this CPU: see row_invariance
    assert compatible(requests, found) is None
    found_on = functools.partial(RowInvariance, "cpu", found.dtype)
    cases = {
        found_on(23, 4096, 4096): "a request of 22 positions is under the 23",
        found_on(1, 54, 54): "the pass would hold 55 positions, more than the 54",
        found_on(None, 4096, 4096): "gives a linear layer's rows other bits",
    }
    for invariance, reason in cases.items():
        assert reason in compatible(requests, invariance)
        with pytest.raises(FailedPrecondition, match=reason):
            run_together(requests, invariance)


def test_ready_requests_are_grouped_by_what_may_share_a_pass(base, llama_config):
    def session(**config: Any) -> TrainingSession:
        return TrainingSession(
            llama_config(lr_scheduler="constant", **config), device="cpu", base=base
        )

    wider = tiny_token_examples(2, seed=7, min_length=WIDTH + 1, max_length=WIDTH + 1)
    requests = [
        Request(session(**RUNS["ppo"][0]), _tokens(2, 0), "ppo"),
        Request(session(**RUNS["text"][0]), wider),
        Request(session(**RUNS["text"][0]), _texts(2, 0)),
        Request(session(lora=LoraSettings(r=4, alpha=8, dropout=0.1)), _tokens(3, 1)),
        Request(session(**RUNS["cross_entropy"][0]), wider),
        Request(session(**RUNS["cross_entropy"][0]), []),  # refused alone: empty
    ]
    invariance = row_invariance(requests[0].session.model)
    assert group_together(requests, invariance) == [[0, 2], [1, 4], [3], [5]]
