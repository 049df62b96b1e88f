"""A sharded session resumed from a checkpoint at any cut of a short run ends with the
uninterrupted run's bits, on the same two ranks. LoRA with dropout: each rank's RNG is part of
the continuation, beside the adapter, its moments and the frozen base (full weights resume from
one cut in tests/test_sharded_session.py). The cuts fall after text and token microbatches
(gradients pending), after an update and after a clipped one."""

from __future__ import annotations

import pytest
import sharded_runs as runs
import sharded_workers as workers

from trainwire.testing import make_tiny_model


@pytest.mark.slow
def test_a_resume_from_every_cut_ends_with_the_uninterrupted_bits(model_root, tmp_path):
    lora, dropout = True, 0.1
    model = make_tiny_model(model_root / "sharded-llama")
    spec = {"model": str(model), "lora": lora, "dropout": dropout, "out": str(tmp_path)}
    ranks = workers.launch(2, "resume_every_cut", spec)
    assert ranks[0] == ranks[1], "every rank reports the same digests"
    report = ranks[0]
    assert len(report["resumed"]) == len(runs.cut_operations()) + 1
    assert report["resumed"] == [report["uninterrupted"]] * len(report["resumed"])
