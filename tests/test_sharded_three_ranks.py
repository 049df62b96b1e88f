"""Three ranks and batches that never divide evenly over them.

The other sharded tests run two ranks, where a batch of 3 splits 2 + 1 at most. Here three CPU
processes over gloo (``sharded_workers.launch``) run seven texts in microbatches of five (5, then
the remainder 2), all seven in one microbatch and four token sequences, so the ranks hold
2 + 2 + 1, 1 + 1 + 0 (a stand-in), 3 + 2 + 2, 2 + 1 + 1 and 1 + 0 + 0 examples, between two
updates (the second clipped by the norm over three ranks' shards). What docs/SHARDING.md promises
on a fixed world size is checked bit for bit: the same operations on fresh sessions give the same
digest and results, and a checkpoint (LoRA with dropout: at every cut) resumes to the
uninterrupted run's digest and results. What
it promises against one process (the same sums added in another order) is checked to the
tolerance tests/test_sharded_session.py explains.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import sharded_workers as workers
import torch.distributed as dist
from test_sharded_session import _close

from trainwire.client import TrainingConfig
from trainwire.testing import make_tiny_model, tiny_text_examples

RANKS = 3
SEVEN = tiny_text_examples(7)
MICROBATCH = 5  # seven examples in microbatches of five: 5 and a remainder of 2
# Full weights without dropout are compared with one process (dropout's masks depend on the
# split); LoRA with dropout makes each rank's RNG, consumed by uneven slices, part of the state.
MODES = {"full": (False, 0.0), "lora": (True, 0.1)}
# Where a checkpoint is taken (after how many operations): every cut for LoRA with dropout, and
# for full weights (whose moments are the largest state) after the stand-in and after the
# clipped update, which keeps the module near half a minute.
CUTS = {"full": (2, 6), "lora": tuple(range(9))}


def uneven_tokens() -> list[Any]:
    """Four token sequences of unequal lengths: 2 + 1 + 1 over three ranks."""
    return [*workers.token_examples(), workers.token_examples()[0]]


def uneven_operations() -> list[Callable[[Any], Any]]:
    """Each call with its split over three ranks; each returns what it gave, as JSON holds it."""
    result = workers._result
    return [
        lambda s: s.forward_backward(SEVEN[:MICROBATCH]),  # 2 + 2 + 1
        lambda s: s.forward_backward(SEVEN[MICROBATCH:]),  # 1 + 1 + 0: rank 2 runs a stand-in
        lambda s: asdict(s.optim_step()),
        lambda s: s.forward_backward(SEVEN),  # 3 + 2 + 2 in one microbatch
        lambda s: result(s.forward_backward(uneven_tokens(), loss_fn="ppo")),  # 2 + 1 + 1
        lambda s: asdict(s.optim_step(max_grad_norm=0.05)),  # clipped
        lambda s: asdict(s.forward(SEVEN)),
        lambda s: s.forward_backward(SEVEN[6:]),  # 1 + 0 + 0, left pending
    ]


def uneven_config(model: str, lora: bool, dropout: float) -> TrainingConfig:
    return replace(workers.make_config(model, lora, dropout), batch_size=MICROBATCH)


def _session(config: TrainingConfig, group: dist.ProcessGroup | None) -> Any:
    from trainwire.server.engine.session import TrainingSession

    return TrainingSession(config, max_steps=workers.MAX_STEPS, process_group=group)


def three_uneven_ranks(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """On each rank, for each mode: the operations twice on fresh sessions (what each gave, the
    digests), then for each of ``CUTS`` k a session that ran the first k saves a checkpoint and
    a fresh one loads it and runs the rest (what those gave, the final digests)."""
    operations, report = uneven_operations(), {}
    for mode, (lora, dropout) in MODES.items():
        config = uneven_config(spec["model"], lora, dropout)
        seen, digests = [], []
        for _ in range(2):
            session = _session(config, group)
            seen.append([operation(session) for operation in operations])
            digests.append(session.state_digest())
        resumed, continued = [], []
        for cut in CUTS[mode]:
            before = _session(config, group)
            for operation in operations[:cut]:
                operation(before)
            checkpoint = Path(spec["out"]) / f"{mode}-cut-{cut}"
            before.save_state(checkpoint)
            after = _session(config, group)
            after.load_state(checkpoint)
            continued.append([operation(after) for operation in operations[cut:]])
            resumed.append(after.state_digest())
        report[mode] = {
            "seen": seen,
            "digests": digests,
            "resumed": resumed,
            "continued": continued,
        }
    return report


@pytest.fixture(scope="module")
def three_ranks(
    tmp_path_factory: pytest.TempPathFactory, model_root: Path
) -> tuple[str, list[dict[str, Any]]]:
    """The scenario on three rank processes, once for the module: (model, reports by rank)."""
    model = make_tiny_model(model_root / "sharded-llama")
    spec = {"model": str(model), "out": str(tmp_path_factory.mktemp("three-ranks"))}
    return str(model), workers.launch(RANKS, "test_sharded_three_ranks:three_uneven_ranks", spec)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_three_uneven_ranks_give_the_same_bits_twice(three_ranks, mode) -> None:
    _, reports = three_ranks
    first, second = reports[0][mode]["digests"]
    assert first == second
    assert reports[0][mode]["seen"][0] == reports[0][mode]["seen"][1]
    for report in reports[1:]:  # every rank returns the whole batch's results and digest
        assert report[mode]["digests"] == [first, second]
        assert report[mode]["seen"] == reports[0][mode]["seen"]


@pytest.mark.slow
def test_three_uneven_ranks_compute_what_one_process_computes(three_ranks) -> None:
    """Every loss, metric, prediction, rate and gradient norm, to test_sharded_session's
    REL/ABS: a slice counted twice, a stand-in that counted, or a share taken from one rank's
    tokens would be off by far more."""
    model, reports = three_ranks
    one = _session(uneven_config(model, *MODES["full"]), None)
    seen = json.loads(json.dumps([operation(one) for operation in uneven_operations()]))
    _close(seen, reports[0]["full"]["seen"][0])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_resume_on_three_uneven_ranks_ends_with_the_uninterrupted_bits(three_ranks, mode):
    _, reports = three_ranks
    assert len(uneven_operations()) + 1 == len(CUTS["lora"])  # every cut, the end included
    for report in reports:
        run = report[mode]
        uninterrupted, seen = run["digests"][0], run["seen"][0]
        assert run["resumed"] == [uninterrupted] * len(CUTS[mode])
        # Each continuation gives, call for call, what the uninterrupted run gave from there.
        assert run["continued"] == [seen[cut:] for cut in CUTS[mode]]
