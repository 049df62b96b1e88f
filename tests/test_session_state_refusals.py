"""load_state refusals: a used session, another config, max_steps or device type, what is not a
checkpoint, a planted pickle (never unpickled) and a damaged file are each refused before anything
changes, and a restored session owns its state (a checkpoint rewritten afterwards never reaches it).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from fresh_state import fresh_digest
from safetensors.torch import load_file, save_file

from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.session import checkpoint as ckpt
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.testing import tiny_text_examples


@pytest.fixture
def checkpoint(llama_config, tmp_path) -> Path:
    """A checkpoint of a llama session (constant schedule) after one microbatch."""
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    session.forward_backward(tiny_text_examples(3))
    session.save_state(tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def test_load_state_refuses_a_used_session(llama_config, checkpoint) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    session.forward_backward(tiny_text_examples(3))
    digest = fresh_digest(session)
    with pytest.raises(FailedPrecondition, match=r"needs a fresh session.*1 operation"):
        session.load_state(checkpoint)
    assert fresh_digest(session) == digest


def test_load_state_refuses_another_config_naming_each_difference(llama_config, checkpoint) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant", learning_rate=2e-3))
    digest = fresh_digest(session)
    with pytest.raises(
        FailedPrecondition, match=r"config fingerprint.*learning_rate: saved 0\.001, now 0\.002"
    ):
        session.load_state(checkpoint)
    assert fresh_digest(session) == digest
    assert session.is_fresh


def test_load_state_refuses_another_max_steps(llama_config, checkpoint) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant"), max_steps=9)
    with pytest.raises(FailedPrecondition, match=r"max_steps: saved None, now 9"):
        session.load_state(checkpoint)


def test_load_state_refuses_another_device_type(llama_config, checkpoint) -> None:
    meta_path = checkpoint / ckpt.SESSION_FILE
    meta = json.loads(meta_path.read_text())
    meta["device_type"] = "cuda"
    meta_path.write_text(json.dumps(meta))
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    digest = fresh_digest(session)
    with pytest.raises(FailedPrecondition, match=r"device type: saved cuda, now cpu"):
        session.load_state(checkpoint)
    assert fresh_digest(session) == digest


def test_load_state_refuses_what_is_not_a_checkpoint(llama_config, tmp_path, tiny_llama) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    with pytest.raises(NotFound, match="no checkpoint at"):
        session.load_state(tmp_path / "missing")
    with pytest.raises(InvalidArgument, match="is not a session checkpoint"):
        session.load_state(tiny_llama)
    assert session.is_fresh


class _Payload:
    """Unpickling this creates ``marker``: what an attacker's pickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_is_refused_and_never_unpickled(
    llama_config, checkpoint, tmp_path
) -> None:
    proof = tmp_path / "proof-the-payload-is-live"
    pickle.loads(pickle.dumps(_Payload(proof)))
    assert proof.exists()

    marker = tmp_path / "pwned"
    planted = checkpoint / ckpt.OPTIMIZER_FILE
    torch.save({"state": _Payload(marker)}, planted)  # a pickle in the optimizer's place
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    digest = fresh_digest(session)
    with pytest.raises(
        InvalidArgument, match=r"optimizer\.safetensors: not a readable safetensors"
    ):
        session.load_state(checkpoint)
    assert not marker.exists()
    assert fresh_digest(session) == digest and session.is_fresh


def _rewrite_in_place(path: Path, change) -> None:
    """Rewrite a safetensors file's tensor data in place, as a careless copy over it would."""
    rewritten = path.with_suffix(".rewritten")
    save_file({name: change(t.clone()) for name, t in load_file(path).items()}, rewritten)
    with open(path, "r+b") as handle:
        handle.write(rewritten.read_bytes())


def test_a_restored_session_owns_its_state(llama_config, tmp_path) -> None:
    """A checkpoint rewritten in place after load_state never reaches the live session."""
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    session.forward_backward(tiny_text_examples(3))
    session.optim_step()
    session.forward_backward(tiny_text_examples(6)[3:])
    session.save_state(tmp_path / "checkpoint")
    restored = TrainingSession(llama_config(lr_scheduler="constant"))
    restored.load_state(tmp_path / "checkpoint")
    digest = fresh_digest(restored)
    for name in (ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, ckpt.GRADIENTS_FILE, ckpt.RNG_FILE):
        _rewrite_in_place(tmp_path / "checkpoint" / name, torch.zeros_like)
    restored.drop_digest_cache()
    assert fresh_digest(restored) == digest


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (ckpt.OPTIMIZER_FILE, r"optimizer state '0\.exp_avg' is torch\.float32 \(1,\)"),
        (ckpt.GRADIENTS_FILE, r"gradients do not fit this model: .*shape \(1,\)"),
    ],
)
def test_a_damaged_checkpoint_is_refused_before_anything_changes(
    llama_config, tmp_path, name, message
) -> None:
    session = TrainingSession(llama_config(lr_scheduler="constant"))
    session.forward_backward(tiny_text_examples(3))
    session.optim_step()
    session.forward_backward(tiny_text_examples(3))
    session.save_state(tmp_path / "checkpoint")
    tensors = load_file(tmp_path / "checkpoint" / name)
    last = sorted(tensors)[-1]  # every other tensor stays valid, so a partial apply would show
    damaged_key = "0.exp_avg" if name == ckpt.OPTIMIZER_FILE else last
    tensors[damaged_key] = torch.zeros(1)
    save_file(tensors, tmp_path / "checkpoint" / name)

    fresh = TrainingSession(llama_config(lr_scheduler="constant"))
    digest = fresh_digest(fresh)
    with pytest.raises(InvalidArgument, match=message):
        fresh.load_state(tmp_path / "checkpoint")
    assert fresh_digest(fresh) == digest and fresh.is_fresh
