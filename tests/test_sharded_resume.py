"""A sharded session resumed from a checkpoint at any cut of a short run ends with the
uninterrupted run's bits, on the same two ranks: full weights, and LoRA with dropout (each
rank's RNG is part of the continuation). The cuts fall after text and token microbatches
(gradients pending), after an update and after a clipped one."""

from __future__ import annotations

import pytest
import sharded_runs as runs
import sharded_workers as workers

from trainwire.testing import make_tiny_model

MODES = {"full": (False, 0.0), "lora": (True, 0.1)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_resume_from_every_cut_ends_with_the_uninterrupted_bits(mode, model_root, tmp_path):
    lora, dropout = MODES[mode]
    model = make_tiny_model(model_root / "sharded-llama")
    spec = {"model": str(model), "lora": lora, "dropout": dropout, "out": str(tmp_path)}
    ranks = workers.launch(2, "resume_every_cut", spec)
    assert ranks[0] == ranks[1], "every rank reports the same digests"
    report = ranks[0]
    assert len(report["resumed"]) == len(runs.cut_operations()) + 1
    assert report["resumed"] == [report["uninterrupted"]] * len(report["resumed"])
