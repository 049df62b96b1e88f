"""Sampling clients of kind ``inflight`` (SDK 0.38): every inflight sampling client of a model reads
the model's latest inflight save (never older weights than when it was made), while a snapshot
client keeps its own; each reads the trainer-exact logprobs of the weights it reads. And which
sampling sessions a restart's replay is still to make."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tinker import types
from tinker_loops import SENTENCES, RawFront, lora_training, train_step

from trainwire.server.errors import NotFound
from trainwire.server.tinker.sampling_sessions import SamplingSessions


def drawn(client: Any, prompt: types.ModelInput) -> list[tuple[list[int], list[float]]]:
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    result = client.sample(prompt, 2, params).result(timeout=60)
    return [(list(seq.tokens), list(seq.logprobs)) for seq in result.sequences]


def test_inflight_clients_follow_their_models_inflight_saves_and_snapshots_stay(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    with lora_training(tmp_path / "state", model_root) as run:
        prompt = types.ModelInput.from_ints(run.tokenizer.encode("the cat"))
        inflight = run.training.save_weights_and_get_sampling_client(kind="inflight").result()
        first = run.training.save_weights_and_get_sampling_client().result()
        before = drawn(first, prompt)
        assert drawn(inflight, prompt) == before
        train_step(run, SENTENCES[0])
        assert drawn(inflight, prompt) == before  # no inflight save since: its weights stay
        later = run.training.save_weights_and_get_sampling_client(kind="inflight").result()
        now = run.training.save_weights_and_get_sampling_client().result()
        after = drawn(now, prompt)
        assert after != before
        assert drawn(inflight, prompt) == after  # moved with the model's inflight save
        assert drawn(later, prompt) == after
        train_step(run, SENTENCES[1])  # the live weights move on: both read the saved ones
        assert drawn(inflight, prompt) == drawn(later, prompt) == after
        assert drawn(first, prompt) == before  # a snapshot client keeps its own weights

        front = RawFront(run.handle.tinker.base_url)
        body = {"model_id": run.training.model_id, "seq_id": 99, "sampling_session_seq_id": 9}
        refused = front.post("save_weights_for_sampler", {**body, "kind": "other"})
        assert refused.status_code == 400 and "snapshot or inflight" in refused.text
        named = front.post(
            "save_weights_for_sampler", {**body, "seq_id": 100, "kind": "inflight", "path": "x"}
        )
        assert named.status_code == 400 and "inflight weights have no name" in named.text


def test_a_sampling_session_a_replayed_call_is_to_make_is_known_while_the_replay_runs() -> None:
    """After a restart, the SDK keeps polling and sampling a sampling session whose snapshot
    call is replayed but has not run yet: it is answered while the replay runs (a 404 there is
    one the SDK does not retry), and unknown once the replay is over and nothing made it."""
    sessions = SamplingSessions()
    sessions.expect("tw-a:sample:0", "tw-a:train:0")
    sessions.require("tw-a:sample:0", replaying=True)
    with pytest.raises(NotFound):
        sessions.require("tw-a:sample:0", replaying=False)
    with pytest.raises(NotFound):
        sessions.require("tw-a:sample:1", replaying=True)  # nothing is to make this one
    assert sessions.model_of("tw-a:sample:0") == "tw-a:train:0"  # its samples take its turns
