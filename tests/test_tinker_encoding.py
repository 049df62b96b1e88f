"""A keyed SDK call's response is encoded when it is fetched, off the engine thread: its journal
entry is its durable record, so the engine runs the next call instead of encoding. A result
nobody fetched before a checkpoint compacted the request log is encoded then, carried, and
answered the same after a restart."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from tinker import types
from tinker_loops import RawFront, lora_training, supervised_datum, tinker_server

from trainwire.server.tinker import codec, training_routes


def test_the_sdk_forward_backward_output_is_encoded_off_the_engine_thread(
    tmp_path: Path, model_root: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    encode = training_routes._encode_forward_backward

    def recorded(*args: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return encode(*args)

    monkeypatch.setattr(training_routes, "_encode_forward_backward", recorded)
    with lora_training(tmp_path / "state", model_root) as run:
        datum = supervised_datum(run.tokenizer, "the cat sat on the mat")
        sent = [run.training.forward_backward([datum], "cross_entropy") for _ in range(3)]
        step = run.training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses = [future.result(timeout=120).metrics["loss:sum"] for future in sent]
        step.result(timeout=120)
    assert len(losses) == 3 and losses[0] == losses[1] == losses[2]  # no update between them
    assert len(threads) == 3 and "trainwire-engine" not in threads


def test_a_result_nobody_fetched_before_a_compaction_is_answered_after_a_restart(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    state_dir = tmp_path / "state"
    with tinker_server(state_dir, model_root) as handle:
        api = RawFront(handle.tinker.base_url)
        _, model_id = api.model()
        first, second = (api.forward_backward(model_id, seq).json()["request_id"] for seq in (1, 2))
        saved = api.post("save_weights", {"model_id": model_id, "seq_id": 3, "path": "ckpt"})
        assert api.poll(saved.json()["request_id"]).json()["type"] == "save_weights"
        answered = api.poll(first)  # encoded when the save carried it
        assert answered.headers["content-type"] == codec.PROTOBUF
    with tinker_server(state_dir, model_root) as handle:
        api = RawFront(handle.tinker.base_url)
        assert api.poll(first).content == answered.content
        never_fetched = api.poll(second)
        assert never_fetched.headers["content-type"] == codec.PROTOBUF
        assert handle.session_host.info().position == 3  # nothing ran again
