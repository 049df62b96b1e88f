"""A keyed SDK call's response is encoded when it is fetched, off the engine thread: its journal
entry is its durable record, so the engine runs the next call instead of encoding. A result
nobody fetched before a checkpoint compacted the request log is encoded then, carried, and
answered the same after a restart."""

from __future__ import annotations

import threading
from pathlib import Path
from types import FrameType
from typing import Any

from tinker_loops import RawFront, lora_training, supervised_datum, tinker_server

from trainwire.server.tinker import codec

ENGINE_THREAD = "trainwire-engine"


def test_no_front_function_runs_on_the_engine_thread_for_the_sdks_forward_backward(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    """Every call on the engine thread is looked at while the SDK's forward_backwards run and
    are fetched: none is the Tinker front's (its routes, codec, model table)."""
    recording = threading.Event()
    front_calls: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set():
            module = frame.f_globals.get("__name__", "")
            if module.startswith("trainwire.server.tinker"):
                thread = threading.current_thread().name
                front_calls.add(f"{thread}: {module}.{frame.f_code.co_name}")

    threading.setprofile(profile)  # every thread the server starts from here on
    try:
        with lora_training(tmp_path / "state", model_root) as run:
            datum = supervised_datum(run.tokenizer, "the cat sat on the mat")
            recording.set()
            sent = [run.training.forward_backward([datum], "cross_entropy") for _ in range(3)]
            losses = [future.result(timeout=120).metrics["loss:sum"] for future in sent]
            recording.clear()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert len(losses) == 3 and losses[0] == losses[1] == losses[2]  # no update between them
    assert any("answers.forward_backward" in call for call in front_calls)  # it was seen
    assert not [call for call in front_calls if call.startswith(f"{ENGINE_THREAD}:")]


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
