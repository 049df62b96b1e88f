"""What each rank of a sharded-session test runs, in its own process (gloo on the CPU).

``launch(world_size, scenario, spec, out)`` spawns the ranks; each joins a gloo group, runs
the scenario (``SCENARIOS`` here, whole runs and weights in and out in ``sharded_runs``, or
``"module:function"`` for one kept beside its test) on ``(spec, group)`` and writes what it saw to
``out/rank<r>.json`` for the test to compare. The operations live here too
(``apply_operations``), so the single-process reference in the test runs exactly the calls the
ranks run.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainwire.client import LoraSettings, TrainingConfig
from trainwire.contract.tokens import TokenExample
from trainwire.server.engine.loss.losses import LOSSES
from trainwire.testing import (
    SENTIMENT_LABELS,
    free_port,
    tiny_sentiment_examples,
    tiny_text_examples,
)

TEXTS = tiny_text_examples(5)
MAX_STEPS = 20


def token_examples() -> list[TokenExample]:
    """Three token sequences of unequal lengths with every input any loss needs."""
    rows = []
    for index, length in enumerate((7, 4, 9)):
        tokens = [5 + (index * 7 + i * 3) % 40 for i in range(length + 1)]
        rows.append(
            TokenExample(
                tokens[:-1],
                tokens[1:],
                weights=[1.0 - 0.1 * (i % 3) for i in range(length)],
                logprobs=[-3.0 - 0.05 * i for i in range(length)],
                advantages=[(-1.0) ** (index + i) * 0.5 for i in range(length)],
                sequence_ratio_mask=[1.0 if i >= 1 else 0.0 for i in range(length)],
            )
        )
    return rows


def make_config(model: str, lora: bool, dropout: float = 0.0) -> TrainingConfig:
    return TrainingConfig(
        model=model,
        task="causal-lm",
        lora=LoraSettings(r=4, alpha=8, dropout=dropout) if lora else None,
        batch_size=3,
        max_length=64,
        learning_rate=1e-3,
        weight_decay=0.01,
        max_grad_norm=1.0,
    )


def _result(value: Any) -> Any:
    return value if isinstance(value, float) else asdict(value)


def apply_operations(session: Any) -> list[Any]:
    """Text and token batches, every loss, two updates (the second clipped); what each gave."""
    seen: list[Any] = [session.forward_backward(TEXTS[:3])]  # 2 + 1 examples on 2 ranks
    seen.append(_result(session.forward_backward(token_examples())))
    seen.append(asdict(session.optim_step()))
    for loss_fn in LOSSES:
        seen.append(_result(session.forward_backward(token_examples(), loss_fn=loss_fn)))
    seen.append(_result(session.forward(token_examples(), loss_fn="ppo")))
    seen.append(_result(session.forward(TEXTS[3:])))
    # Fewer examples than ranks: the second rank runs a stand-in that counts zero.
    seen.append(session.forward_backward(TEXTS[4:]))
    seen.append(_result(session.forward_backward(token_examples()[:1], loss_fn="ppo")))
    seen.append(asdict(session.optim_step(max_grad_norm=0.05)))
    return seen


def two_more_steps(session: Any) -> list[Any]:
    seen = []
    for texts in (TEXTS[:2], TEXTS[2:]):
        seen.append(session.forward_backward(texts))
        seen.append(asdict(session.optim_step()))
    return seen


def _session(spec: dict[str, Any], group: dist.ProcessGroup, *, lora: bool, dropout: float):
    from trainwire.server.engine.session import TrainingSession

    config = make_config(spec["model"], lora, dropout)
    return TrainingSession(config, max_steps=MAX_STEPS, process_group=group)


def train_and_checkpoint(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """Twice the same operations on fresh sessions; a checkpoint, two more steps, and the same
    two steps on a fresh session restored from it; an export and the logits it should give."""
    lora, dropout, out = spec["lora"], spec["dropout"], Path(spec["out"])
    first = _session(spec, group, lora=lora, dropout=dropout)
    first_seen = apply_operations(first)
    second = _session(spec, group, lora=lora, dropout=dropout)
    second_seen = apply_operations(second)
    report = {
        "digests": [first.state_digest(), second.state_digest()],
        "seen": [first_seen, second_seen],
        # What one process is compared with: without dropout, whose masks depend on the split.
        "seen_without_dropout": first_seen
        if dropout == 0.0
        else apply_operations(_session(spec, group, lora=lora, dropout=0.0)),
    }
    second.save_state(out / "checkpoint", extra={"note": "two ranks"})
    report["saved_digest"] = second.state_digest()
    report["saved_forward"] = second.forward(TEXTS[:3]).loss
    report["continued"] = two_more_steps(second)
    report["continued_digest"] = second.state_digest()
    restored = _session(spec, group, lora=lora, dropout=dropout)
    report["extra"] = restored.load_state(out / "checkpoint")
    report["restored_digest"] = restored.state_digest()
    report["restored_continued"] = two_more_steps(restored)
    report["restored_continued_digest"] = restored.state_digest()
    restored.export_weights(out / "export")
    report["export_logprobs"] = restored.forward(token_examples()).logprobs
    report["checkpointed_digest"] = _checkpointed(spec, group, lora, dropout)
    return report


def _checkpointed(spec: dict[str, Any], group: dist.ProcessGroup, lora: bool, dropout: float):
    """The same operations on a session that recomputes activations (gradient checkpointing):
    its digest, to equal the plain run's."""
    from dataclasses import replace

    from trainwire.server.engine.session import TrainingSession

    config = replace(make_config(spec["model"], lora, dropout), gradient_checkpointing=True)
    session = TrainingSession(config, max_steps=MAX_STEPS, process_group=group)
    apply_operations(session)
    return session.state_digest()


def resume_elsewhere(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """Checkpoints of another world size, each loaded and trained on: what the loss did."""
    report = {}
    for name, case in spec["cases"].items():
        session = _session(spec, group, lora=case["lora"], dropout=case["dropout"])
        session.load_state(Path(case["checkpoint"]))
        first = session.forward(TEXTS[:3]).loss
        for _ in range(3):
            session.forward_backward(TEXTS[:3])
            session.optim_step()
        report[name] = {"first": first, "after": session.forward(TEXTS[:3]).loss}
    damaged = _session(spec, group, lora=False, dropout=0.0)
    try:
        damaged.load_state(Path(spec["damaged"]))
    except Exception as error:  # the test reads the message
        report["damaged"] = f"{type(error).__name__}: {error}"
    report["broken"] = damaged.broken or ""
    return report


def classifier_config(model: str) -> TrainingConfig:
    return TrainingConfig(
        model=model,
        task="sequence-classification",
        labels=SENTIMENT_LABELS,
        batch_size=3,
        max_length=64,
        learning_rate=1e-3,
        max_grad_norm=1.0,
    )


def classify_operations(session: Any) -> list[Any]:
    """A classifier's mean over examples, split 2 + 1 and 1 + 0; its predictions, in order."""
    examples = tiny_sentiment_examples(5)
    seen: list[Any] = [session.forward_backward(examples[:3])]
    seen.append(session.forward_backward(examples[3:4]))
    seen.append(asdict(session.optim_step()))
    seen.append(asdict(session.forward(examples)))
    return seen


def classify(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    from trainwire.server.engine.session import TrainingSession

    session = TrainingSession(classifier_config(spec["model"]), process_group=group)
    return {"seen": classify_operations(session), "digest": session.state_digest()}


SCENARIOS: dict[str, Callable[[dict[str, Any], dist.ProcessGroup], dict[str, Any]]] = {
    "train_and_checkpoint": train_and_checkpoint,
    "resume_elsewhere": resume_elsewhere,
    "classify": classify,
}


def _rank(rank: int, world_size: int, port: int, scenario: str, spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # two ranks share the runner's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        report = _scenario(scenario)(spec, dist.group.WORLD)
        dist.barrier()  # every rank is done with the group before any tears it down
        path = Path(spec["out"]) / f"rank{rank}.json"
        path.write_text(json.dumps(report, allow_nan=True))
    finally:
        dist.destroy_process_group()
    # Straight out, past the interpreter's finalization: gloo's worker threads may still hold
    # objects whose release at that point aborts the process (SIGABRT, "terminate called
    # without an active exception"; seen twice here, in launches under load), after the
    # report the test reads is written.
    os._exit(0)


def _scenario(name: str) -> Callable[[dict[str, Any], dist.ProcessGroup], dict[str, Any]]:
    """A scenario by name: one of ``SCENARIOS`` or ``sharded_runs``', or ``"module:function"``
    for one that lives beside the test that runs it."""
    if ":" in name:
        module, _, function = name.partition(":")
        return getattr(importlib.import_module(module), function)
    # Imported here, in the rank: sharded_runs builds on this module's data and sessions.
    from sharded_runs import RUN_SCENARIOS

    return {**SCENARIOS, **RUN_SCENARIOS}[name]


def launch(world_size: int, scenario: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world_size`` fresh processes; each rank's report, in rank order."""
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _rank,
        args=(world_size, free_port(), scenario, spec),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
    out = Path(spec["out"])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
