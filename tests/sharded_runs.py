"""Scenarios a sharded-session test runs on each rank (``sharded_workers.launch``) that cover
whole runs and weights in and out: checkpoints for the one-process readers, a managed run and
an SDK loop's calls for the served group to equal, a resume from every cut, exports and loads,
sampling. The operations and sessions they build on are ``sharded_workers``'.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch.distributed as dist
from sharded_workers import TEXTS, _session, token_examples, two_more_steps

from trainwire.client import TrainingConfig
from trainwire.contract.tokens import TokenExample

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
    from trainwire.server.engine.weights.transfer import WeightsLoad

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
    report["missing"] = raised(lambda: source.export_checkpoint_weights(out / "none", out / "x"))

    target = _session(spec, group, lora=lora, dropout=0.0)
    digest = target.state_digest()
    report["wrong_shape"] = raised(lambda: target.load_weights(Path(spec["wrong_shape"])))
    # A full-weights run's sharded checkpoint (the "full" pass runs first) in a LoRA session.
    other = Path(spec["out"]) / "full" / "checkpoint"
    report["other_settings"] = raised(lambda: target.load_weights(other)) if lora else ""
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
        report["midway"] = raised(lambda: target.load_weights(out / "at-save"))
    report["broken"] = target.broken or ""
    return report


def weights_seen(session: Any) -> dict[str, Any]:
    """What a session's weights are and give: every parameter whole, hashed by name (a
    collective on a sharded session), the logprobs of a token batch, the base fingerprint and
    the step (a weights load leaves the run's schedule where it was)."""
    from trainwire.server.engine.session.digest import update_with_tensors
    from trainwire.server.engine.sharded.sharding import full_tensor

    parameters = {name: full_tensor(p.detach()) for name, p in session.model.named_parameters()}
    digest = hashlib.sha256()
    update_with_tensors(digest, parameters)
    return {
        "parameters": digest.hexdigest(),
        "logprobs": session.forward(token_examples()).logprobs,
        "base": session.base_fingerprint,
        "step": session.step,
    }


def raised(call: Callable[[], Any]) -> str:
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


RUN_SCENARIOS: dict[str, Callable[[dict[str, Any], dist.ProcessGroup], dict[str, Any]]] = {
    "save_checkpoints": save_checkpoints,
    "weights_in_and_out": weights_in_and_out,
    "managed_run": managed_run,
    "token_steps": token_steps,
    "resume_every_cut": resume_every_cut,
    "sampling": sampling,
}
