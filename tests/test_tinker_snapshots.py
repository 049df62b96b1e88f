"""Sampling a snapshot the trainer has moved past, through the real SDK: the snapshot's samples,
and a clear refusal once an unnamed snapshot was pruned. (The engine's side, every live bit back
after other weights were sampled, is tests/test_session_snapshot_sampling.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker import types
from tinker_loops import SENTENCES, lora_training, train_step

from trainwire.server.tinker.sampling_sessions import KEEP_UNNAMED_SNAPSHOTS


def test_an_unnamed_snapshot_samples_as_it_did_until_it_is_pruned(
    tmp_path: Path, model_root: Path, tiny_llama: Path
) -> None:
    import tinker

    with lora_training(tmp_path / "state", model_root) as run:
        prompt = types.ModelInput.from_ints(run.tokenizer.encode("the cat"))
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
        first = run.training.save_weights_and_get_sampling_client().result()
        before = first.sample(prompt, 2, params).result()
        train_step(run, SENTENCES[1])  # the live weights are no longer the snapshot
        again = first.sample(prompt, 2, params).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in before.sequences]
        assert [s.logprobs for s in again.sequences] == [s.logprobs for s in before.sequences]
        for _ in range(KEEP_UNNAMED_SNAPSHOTS):
            run.training.save_weights_and_get_sampling_client().result()
        with pytest.raises(tinker.RequestFailedError, match=r"pruned.*save_weights_and_get"):
            first.sample(prompt, 2, params).result()
