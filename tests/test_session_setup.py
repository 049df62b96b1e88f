"""Opening a TrainingSession: a refused precision, device, argument or process setup fails before
anything is allocated, and model paths resolve under the model root.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainwire.client import TrainingConfig
from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session import session as session_module
from trainwire.server.errors import InvalidArgument, NotFound
from trainwire.testing import tiny_text_examples

TEXTS = tiny_text_examples(6)


def test_fp16_and_worker_processes_are_refused_by_the_config(llama_config) -> None:
    with pytest.raises(ValueError, match="precision: fp16 is not supported"):
        llama_config(precision="fp16")
    with pytest.raises(ValueError, match="num_workers: must be 0"):
        llama_config(num_workers=2)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if a session gets as far as loading its tokenizer or model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the session allocated before refusing")

    monkeypatch.setattr(session_module, "load_tokenizer", refuse)
    monkeypatch.setattr(session_module, "load_session_model", refuse)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_bf16_and_cuda_on_a_cpu_machine_are_refused_before_allocating(
    llama_config, no_model_loading
) -> None:
    with pytest.raises(ValueError, match=r"precision bf16 needs a CUDA device.*fp32"):
        TrainingSession(llama_config(precision="bf16"), device="cpu")
    with pytest.raises(ValueError, match="precision bf16 needs a CUDA device"):
        TrainingSession(llama_config(precision="bf16"))
    with pytest.raises(ValueError, match="CUDA is not available"):
        TrainingSession(llama_config(), device="cuda")


def test_bad_session_arguments_are_refused_before_allocating(
    llama_config, no_model_loading, monkeypatch
) -> None:
    with pytest.raises(ValueError, match="only cpu and cuda"):
        TrainingSession(llama_config(), device="meta")
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        TrainingSession(llama_config(), max_steps=0)
    with pytest.raises(ValueError, match="config must be a TrainingConfig"):
        TrainingSession(llama_config().to_dict())  # type: ignore[arg-type]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2"):
        TrainingSession(llama_config())
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="distributed process group"):
        TrainingSession(llama_config())


def test_model_paths_resolve_under_the_model_root(
    model_root, tiny_llama, tmp_path, no_model_loading
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    for name in ("../outside", str(outside)):
        config = TrainingConfig(model=name)
        with pytest.raises(InvalidArgument, match="resolves outside the model root"):
            TrainingSession(config, model_root=tmp_path / "root-that-holds-nothing")
    link_root = tmp_path / "root"
    link_root.mkdir()
    os.symlink(outside, link_root / "escape")
    with pytest.raises(InvalidArgument, match="'escape' resolves outside the model root"):
        TrainingSession(TrainingConfig(model="escape"), model_root=link_root)
    with pytest.raises(NotFound, match=r"no config\.json"):
        TrainingSession(TrainingConfig(model="missing"), model_root=model_root)


def test_a_model_named_relative_to_the_model_root_loads(model_root, tiny_llama) -> None:
    name = tiny_llama.relative_to(model_root).as_posix()
    session = TrainingSession(TrainingConfig(model=name, max_length=64), model_root=model_root)
    assert session.model_dir == Path(tiny_llama).resolve()
    assert session.forward(TEXTS[:2]).loss > 0


def test_a_lora_rank_no_weight_can_use_is_refused_with_the_bound(llama_config) -> None:
    """A rank past every weight's smaller dimension only adds parameters and moments (a typo's
    100000 on the tiny model took a gigabyte); the tiny llama's widest is 32."""
    from trainwire.client import LoraSettings
    from trainwire.server.engine.weights.shared_base import SharedBase

    base = SharedBase(llama_config(), device="cpu")
    for shared in (None, base):
        with pytest.raises(InvalidArgument, match=r"rank 33 .* choose a rank from 1 to 32"):
            TrainingSession(llama_config(lora=LoraSettings(r=33)), device="cpu", base=shared)
        widest = TrainingSession(llama_config(lora=LoraSettings(r=32)), device="cpu", base=shared)
        assert widest.forward_backward(TEXTS) > 0
