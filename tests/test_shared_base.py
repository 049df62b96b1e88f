"""LoRA sessions on one ``SharedBase``: one copy of the base weights, the same bits as alone.

Each session's operations are a script (a generator that yields every result); run interleaved on
one base, and each alone on a base of its own, every result and the final digest compare exactly.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from fresh_state import fresh_digest

from trainwire.client import InputExample, LoraSettings, TrainingConfig
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.weights.shared_base import SharedBase
from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.testing import make_tiny_model, tiny_sentiment_examples, tiny_token_examples

TEXTS = [
    InputExample("the movie was great, truly great"),
    InputExample("a dull film", completion=" with no story"),
    InputExample("what a fine day it was"),
]
Script = Callable[[TrainingSession, Path], Iterator[Any]]


def _text_run(session: TrainingSession, out: Path) -> Iterator[Any]:
    """Text examples, the default loss; a checkpoint after the first update."""
    for step in range(2):
        yield session.forward_backward(TEXTS[step : step + 2])
        yield session.optim_step()
        if step == 0:
            session.save_state(out / "text-run")
            session.export_checkpoint_weights(out / "text-run", out / "text-export")
            yield _files(out / "text-export")
    yield session.forward(TEXTS[:1])


def _token_run(session: TrainingSession, out: Path) -> Iterator[Any]:
    """Token examples under importance sampling, a rate of its own per update."""
    for step in range(2):
        yield session.forward_backward(
            tiny_token_examples(3, seed=step), loss_fn="importance_sampling"
        )
        yield session.optim_step(learning_rate=2e-3)


def _sampling_run(session: TrainingSession, out: Path) -> Iterator[Any]:
    """PPO between samples, and an export at the end."""
    prompt = session.tokenize(["the movie was"])[0]
    for step in range(2):
        yield session.sample(prompt, max_tokens=6, num_samples=2, seed=step)
        yield session.forward_backward(tiny_token_examples(2, seed=10 + step), loss_fn="ppo")
        yield session.optim_step()
        yield session.prompt_logprobs(prompt)
    session.export_weights(out / "export")
    yield _files(out / "export")


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


RUNS: dict[str, tuple[dict[str, Any], Script]] = {
    "text": ({"seed": 1, "lora": LoraSettings(r=4, alpha=8, dropout=0.1)}, _text_run),
    "tokens": (
        {"seed": 2, "lora": LoraSettings(r=8, alpha=8, target_modules=("q_proj", "v_proj"))},
        _token_run,
    ),
    "sampling": ({"seed": 3, "lora": LoraSettings(r=4, alpha=16, dropout=0.1)}, _sampling_run),
}


@pytest.fixture
def run_config(llama_config) -> Callable[[str], TrainingConfig]:
    return lambda name: llama_config(lr_scheduler="constant", **RUNS[name][0])


@pytest.fixture
def base(llama_config) -> SharedBase:
    return SharedBase(llama_config(), device="cpu")


def _results(
    sessions: dict[str, TrainingSession], tmp_path: Path, *, interleaved: bool
) -> dict[str, list[Any]]:
    """Every result of each session's script, then its digest hashed afresh."""
    scripts = {}
    for name, session in sessions.items():
        (tmp_path / name).mkdir(parents=True)
        scripts[name] = RUNS[name][1](session, tmp_path / name)
    results: dict[str, list[Any]] = {name: [] for name in sessions}
    order = [list(scripts)] if interleaved else [[name] for name in scripts]
    for group in order:
        live = list(group)
        while live:  # one operation of each session in turn
            for name in list(live):
                try:
                    results[name].append(next(scripts[name]))
                except StopIteration:
                    live.remove(name)
    for name, session in sessions.items():
        results[name].append(fresh_digest(session))
    return results


def test_sessions_on_one_base_give_every_bit_they_give_alone(base, run_config, tmp_path):
    alone = {name: TrainingSession(run_config(name), device="cpu") for name in RUNS}
    shared = {name: TrainingSession(run_config(name), device="cpu", base=base) for name in RUNS}
    expected = _results(alone, tmp_path / "alone", interleaved=False)
    assert _results(shared, tmp_path / "shared", interleaved=True) == expected

    # A fresh session on the base restores the text run's checkpoint and continues as it did.
    checkpoint = tmp_path / "shared" / "text" / "text-run"
    restored = TrainingSession(run_config("text"), device="cpu", base=base)
    restored.load_state(checkpoint)
    continued = [restored.forward_backward(TEXTS[1:3]), restored.optim_step()]
    continued += [restored.forward(TEXTS[:1]), fresh_digest(restored)]
    assert continued == expected["text"][-4:]


def test_sessions_share_the_base_storage_and_train_only_their_adapters(base, run_config):
    first, second = (
        TrainingSession(run_config(name), device="cpu", base=base) for name in ("text", "sampling")
    )
    theirs = dict(second.model.named_parameters())
    frozen = [(name, p) for name, p in first.model.named_parameters() if not p.requires_grad]
    assert frozen and first.trainable_parameters()
    for name, parameter in frozen:
        assert base.holds(parameter)
        assert parameter.data_ptr() == theirs[name].data_ptr()
        assert not theirs[name].requires_grad
    mine = {p.data_ptr() for p in first.trainable_parameters()}
    assert not mine & {p.data_ptr() for p in second.trainable_parameters()}
    assert not any(base.holds(p) for p in first.trainable_parameters())


def test_a_session_frees_its_adapter_and_the_last_holder_the_base(llama_config, run_config):
    base = SharedBase(llama_config(), device="cpu")
    kept, dropped = (TrainingSession(run_config("text"), device="cpu", base=base) for _ in "ab")
    adapter = weakref.ref(dropped.trainable_parameters()[0])
    held = weakref.ref(base)
    del dropped, base
    gc.collect()
    assert adapter() is None and held() is not None  # the other session still holds the base
    kept.forward_backward(TEXTS)
    del kept
    gc.collect()
    assert held() is None


def test_runs_that_would_change_the_base_are_refused(base, llama_config, tmp_path):
    with pytest.raises(InvalidArgument, match="a full-weights run cannot share a base model"):
        TrainingSession(llama_config(), device="cpu", base=base)
    other_model = make_tiny_model(tmp_path / "other-llama", seed=1)
    lora = LoraSettings(r=4, alpha=8)
    with pytest.raises(InvalidArgument, match="is not this base's model"):
        TrainingSession(llama_config(model=str(other_model), lora=lora), device="cpu", base=base)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(InvalidArgument, match="a sharded session cannot run on a shared base"):
            TrainingSession(
                llama_config(lora=lora), device="cpu", base=base, process_group=dist.group.WORLD
            )
    finally:
        dist.destroy_process_group()


def test_loads_of_other_base_weights_are_refused_and_change_nothing(
    base, llama_config, tiny_llama, tmp_path
):
    config = llama_config(lora=LoraSettings(r=4, alpha=8), lr_scheduler="constant")
    other_model = make_tiny_model(tmp_path / "other-llama", seed=1)
    # A run alone whose base another model's weights seeded: its checkpoint carries them.
    reseeded = TrainingSession(config, device="cpu")
    reseeded.load_weights(other_model)
    reseeded.save_state(tmp_path / "reseeded")

    session = TrainingSession(config, device="cpu", base=base)
    session.forward_backward(TEXTS)
    before = fresh_digest(session)
    with pytest.raises(FailedPrecondition, match="load_weights: other-llama holds other base"):
        session.load_weights(other_model)
    with pytest.raises(FailedPrecondition, match="sample: weights 'reseeded' holds other base"):
        session.sample([5, 6], max_tokens=2, weights=tmp_path / "reseeded")
    with pytest.raises(FailedPrecondition, match="export: checkpoint reseeded holds other base"):
        session.export_checkpoint_weights(tmp_path / "reseeded", tmp_path / "export")
    assert fresh_digest(session) == before

    fresh = TrainingSession(config, device="cpu", base=base)
    before = fresh_digest(fresh)
    with pytest.raises(FailedPrecondition, match="load_state: checkpoint reseeded holds other"):
        fresh.load_state(tmp_path / "reseeded")
    assert fresh_digest(fresh) == before and fresh.is_fresh
    # The base's own weights load as they do alone: nothing of the base changes.
    fresh.load_weights(tiny_llama)
    assert fresh_digest(fresh) == before


def test_a_dora_classifier_on_a_shared_base_gives_the_bits_it_gives_alone(llama_classifier_config):
    """The classification head trains as a copy of its own (PEFT's modules_to_save)."""
    lora = LoraSettings(r=4, alpha=8, dropout=0.1, use_dora=True)
    config = llama_classifier_config(lora=lora, lr_scheduler="constant")
    base = SharedBase(config, device="cpu")
    examples = tiny_sentiment_examples(4)
    results = []
    for session in (TrainingSession(config, device="cpu", base=shared) for shared in (None, base)):
        session.forward_backward(examples)
        results.append([session.optim_step(), session.forward(examples), fresh_digest(session)])
        assert not any(base.holds(p) for p in session.trainable_parameters())
    assert results[0] == results[1]


def test_a_model_that_loads_with_fresh_random_weights_is_no_shared_base(llama_config):
    # A causal-lm directory has no classification head: loading one initializes it at random.
    config = llama_config(task="sequence-classification", labels=("no", "yes"))
    with pytest.raises(InvalidArgument, match="initializes weights its directory lacks"):
        SharedBase(config, device="cpu")
