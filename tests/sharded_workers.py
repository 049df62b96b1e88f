"""What each rank of a sharded-session test runs, in its own process (gloo on the CPU).

``launch(world_size, scenario, spec, out)`` spawns the ranks; each joins a gloo group, runs
``SCENARIOS[scenario](spec, group)`` and writes what it saw to ``out/rank<r>.json`` for the test to
compare. The operations live here too (``apply_operations``), so the single-process reference in
the test runs exactly the calls the ranks run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainwire.client import LoraSettings, TrainingConfig
from trainwire.client.tokens import TokenExample
from trainwire.server.engine.losses import LOSSES
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
    report["refusals"] = _refusals(restored, out)
    return report


def _refusals(session: Any, out: Path) -> list[str]:
    """What a sharded session refuses by name, rather than do wrongly."""
    from dataclasses import replace

    from trainwire.server.engine.session import TrainingSession

    messages = []
    checkpointing = replace(session.config, gradient_checkpointing=True)
    calls: list[Callable[[], Any]] = [
        lambda: TrainingSession(checkpointing, process_group=session.shards.group),
    ]
    for call in calls:
        try:
            call()
        except Exception as error:  # the test reads the message
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append("")
    return messages


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


# -- checkpoints only (tests/test_sharded_checkpoint_files.py reads them in one process) --------


def save_checkpoints(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """For each of ``spec["saves"]`` (``{"path", "extra"}``): one more update and a pending
    microbatch (every tensor group filled), then a checkpoint; the state digest at each."""
    session = _session(spec, group, lora=spec["lora"], dropout=spec["dropout"])
    digests = []
    for save in spec["saves"]:
        session.forward_backward(TEXTS[:3])
        session.optim_step()
        session.forward_backward(TEXTS[3:])
        session.save_state(Path(save["path"]), extra=save["extra"])
        digests.append(session.state_digest())
    return {"digests": digests}


# -- a managed run (tests/test_sharded_serve.py compares a served group's run with it) ---------


def managed_run(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """The plan of ``spec["manifest"]`` run uninterrupted in-process on the group, as
    ``trainwire run`` drives a server: its digest, history and export (written by rank 0)."""
    from trainwire.client import ManagedTrainingPlan
    from trainwire.server.engine.managed import ManagedTraining
    from trainwire.server.engine.session import TrainingSession

    plan = ManagedTrainingPlan.from_manifest(json.loads(Path(spec["manifest"]).read_text()))
    session = TrainingSession(plan.config, max_steps=plan.max_steps, process_group=group)
    training = ManagedTraining(session, plan, checkpoint_dir=Path(spec["out"]) / "checkpoints")
    result = training.run()
    training.export_weights(Path(spec["out"]) / "export")
    return {"state_digest": result.state_digest, "history": result.history}


# -- weights in and out (tests/test_sharded_weights.py) ------------------------------------------


def weights_in_and_out(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """For full weights and LoRA: a sharded checkpoint exported, one process's, a missing one;
    then ``load_weights`` from each kind of source, a refused one and one failing midway."""
    return {mode: _weights_of(spec, group, mode) for mode in ("full", "lora")}


def _weights_of(spec: dict[str, Any], group: dist.ProcessGroup, mode: str) -> dict[str, Any]:
    from trainwire.server.engine.weights import WeightsLoad

    lora, out, one_process = mode == "lora", Path(spec["out"]) / mode, spec["one_process"][mode]
    source = _session(spec, group, lora=lora, dropout=0.0)
    two_more_steps(source)
    source.forward_backward(TEXTS[:3])  # pending: in the checkpoint, never in an export
    source.save_state(out / "checkpoint")
    source.export_weights(out / "at-save")
    report: dict[str, Any] = {"saved": weights_seen(source)}
    two_more_steps(source)  # the live weights move on past the checkpoint
    digest = source.state_digest()
    source.export_checkpoint_weights(out / "checkpoint", out / "from-checkpoint")
    source.export_checkpoint_weights(Path(one_process), out / "from-one-process")
    report["untouched"] = source.state_digest() == digest
    report["missing"] = _raised(lambda: source.export_checkpoint_weights(out / "none", out / "x"))

    target = _session(spec, group, lora=lora, dropout=0.0)
    digest = target.state_digest()
    report["wrong_shape"] = _raised(lambda: target.load_weights(Path(spec["wrong_shape"])))
    # A full-weights run's sharded checkpoint (the "full" pass runs first) in a LoRA session.
    other = Path(spec["out"]) / "full" / "checkpoint"
    report["other_settings"] = _raised(lambda: target.load_weights(other)) if lora else ""
    report["unchanged"] = target.state_digest() == digest and not target.broken
    # Each load replaces what the one before left, in an order where each changes the weights.
    for name, path in [
        ("native", Path(spec["native"])),
        ("checkpoint", out / "checkpoint"),
        ("one_process", Path(one_process)),
        ("export", out / "at-save"),
    ]:
        target.load_weights(path)
        report[f"{name}_loaded"] = weights_seen(target)
    with mock.patch.object(WeightsLoad, "apply", side_effect=RuntimeError("pulled midway")):
        report["midway"] = _raised(lambda: target.load_weights(out / "at-save"))
    report["broken"] = target.broken or ""
    return report


def weights_seen(session: Any) -> dict[str, Any]:
    """What a session's weights are and give: every parameter whole, hashed by name (a
    collective on a sharded session), the logprobs of a token batch, the base fingerprint and
    the step (a weights load leaves the run's schedule where it was)."""
    from trainwire.server.engine.digest import update_with_tensors
    from trainwire.server.engine.sharding import full_tensor

    parameters = {name: full_tensor(p.detach()) for name, p in session.model.named_parameters()}
    digest = hashlib.sha256()
    update_with_tensors(digest, parameters)
    return {
        "parameters": digest.hexdigest(),
        "logprobs": session.forward(token_examples()).logprobs,
        "base": session.base_fingerprint,
        "step": session.step,
    }


def _raised(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as error:  # the test reads the message
        return f"{type(error).__name__}: {error}"
    return ""


def token_steps(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """``spec["steps"]`` (each: token examples and an update's settings) as the Tinker front
    applies an SDK loop's calls: a cross-entropy forward_backward, then an update that adds
    the microbatches' gradients. The losses and the final digest."""
    from trainwire.server.engine.session import TrainingSession

    config = TrainingConfig.from_dict(spec["config"])
    session = TrainingSession(
        config, max_steps=spec["max_steps"], model_root=spec["model_root"], process_group=group
    )
    losses = []
    for step in spec["steps"]:
        examples = [TokenExample(**example) for example in step["examples"]]
        losses.append(session.forward_backward(examples, loss_fn="cross_entropy").loss)
        session.optim_step(**step["update"], sum_microbatches=True)
    return {"losses": losses, "state_digest": session.state_digest()}


def sampling(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """Sampling a sharded session (tests/test_sharded_sampling.py): the calls live beside the
    one-process reference that makes them too."""
    from test_sharded_sampling import sampling_calls

    return sampling_calls(spec, group)


# -- a checkpoint at every cut (tests/test_sharded_resume.py) ------------------------------------


def cut_operations() -> list[Callable[[Any], Any]]:
    """A short run whose every cut leaves something different pending: microbatches of text and
    tokens accumulated, an update, a clipped update, the loss hook's state."""
    return [
        lambda s: s.forward_backward(TEXTS[:3]),
        lambda s: s.forward_backward(token_examples(), loss_fn="importance_sampling"),
        lambda s: s.optim_step(),
        lambda s: s.forward_backward(TEXTS[3:]),
        lambda s: s.optim_step(max_grad_norm=0.05),
        lambda s: s.forward_backward(token_examples(), loss_fn="ppo"),
    ]


def resume_every_cut(spec: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """The run uninterrupted, then for each cut k: a session that ran the first k operations
    saves a checkpoint, a fresh one loads it and runs the rest; every final digest."""
    lora, dropout, out = spec["lora"], spec["dropout"], Path(spec["out"])
    operations = cut_operations()
    whole = _session(spec, group, lora=lora, dropout=dropout)
    for operation in operations:
        operation(whole)
    resumed = []
    for cut in range(len(operations) + 1):
        before = _session(spec, group, lora=lora, dropout=dropout)
        for operation in operations[:cut]:
            operation(before)
        before.save_state(out / f"cut-{cut}")
        after = _session(spec, group, lora=lora, dropout=dropout)
        after.load_state(out / f"cut-{cut}")
        for operation in operations[cut:]:
            operation(after)
        resumed.append(after.state_digest())
    return {"uninterrupted": whole.state_digest(), "resumed": resumed}


SCENARIOS: dict[str, Callable[[dict[str, Any], dist.ProcessGroup], dict[str, Any]]] = {
    "train_and_checkpoint": train_and_checkpoint,
    "resume_elsewhere": resume_elsewhere,
    "classify": classify,
    "save_checkpoints": save_checkpoints,
    "weights_in_and_out": weights_in_and_out,
    "managed_run": managed_run,
    "token_steps": token_steps,
    "resume_every_cut": resume_every_cut,
    "sampling": sampling,
}


def _rank(rank: int, world_size: int, port: int, scenario: str, spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # two ranks share the runner's cores
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        report = SCENARIOS[scenario](spec, dist.group.WORLD)
        path = Path(spec["out"]) / f"rank{rank}.json"
        path.write_text(json.dumps(report, allow_nan=True))
    finally:
        dist.destroy_process_group()


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
