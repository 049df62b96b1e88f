"""Which requests may run together (``run_together``) and, when not, why, in words.

A shared pass gives each session its bits alone only when the one module tree it runs computes
what each session's own tree computes, and when stacking changes no product a session's rows
take part in. So the sessions must share one base and train plain LoRA on the same linear
layers the same way, and their requests must have the same padded width (padding a batch to a
wider one changes its attention's bits on the CPU: measured) and enough positions for the
device's row invariance (``row_invariance``). Anything else runs in turns.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from trainwire.server.engine.loss.loss_hook import LossHook
from trainwire.server.engine.together.row_blocks import head_adapter, lora_layers
from trainwire.server.engine.together.row_invariance import RowInvariance
from trainwire.server.errors import InvalidArgument

if TYPE_CHECKING:
    from trainwire.server.engine.session.session import TrainingSession
    from trainwire.server.engine.together.run import Request


def compatible(requests: Sequence[Request], invariance: RowInvariance) -> str | None:
    """None when ``run_together`` gives every request exactly its result alone; else why not.

    Encodes text examples to learn their padded width (token examples need no tokenizer); a
    request its session would refuse is reported here, so the caller runs it alone, where it
    gets its own error.
    """
    problem = session_problem([request.session for request in requests])
    if problem is not None:
        return problem
    shapes = []
    for index, request in enumerate(requests):
        try:
            shapes.append(padded_shape(request))
        except InvalidArgument as error:
            return f"request {index} is refused alone: {error}"
    return shape_problem(shapes, invariance)


def group_together(requests: Sequence[Request], invariance: RowInvariance) -> list[list[int]]:
    """The requests, by index, in groups that ``run_together`` may each run as one pass.

    Each request's padded shape is found once (text is encoded for it). A request joins the
    first earlier group it is ``compatible`` with, else starts its own; groups keep the order
    their first request came in, and so do the requests in each. A group of one runs alone. A
    request its session would refuse, or whose session shares no pass, gets a group of its
    own, where it meets its error or runs alone.
    """
    groups: list[list[int]] = []
    shapes: dict[int, tuple[int, int]] = {}
    for index, request in enumerate(requests):
        if session_problem([request.session]) is not None:  # it shares no pass: not encoded
            groups.append([index])
            continue
        try:
            shapes[index] = padded_shape(request)
        except InvalidArgument:
            groups.append([index])
            continue
        for group in groups:
            if group[0] not in shapes:
                continue
            joined = [*group, index]
            sessions = [requests[i].session for i in joined]
            if session_problem(sessions) is None and (
                shape_problem([shapes[i] for i in joined], invariance) is None
            ):
                group.append(index)
                break
        else:
            groups.append([index])
    return groups


def session_problem(sessions: Sequence[TrainingSession]) -> str | None:
    """Why these sessions cannot share a pass, whatever they are asked, or None."""
    if not sessions:
        return "no request to run"
    if len({id(session) for session in sessions}) < len(sessions):
        return "a session has two requests: its requests run in order, one at a time"
    problem = adapters_problem(sessions)
    if problem is not None:
        return problem
    first = sessions[0]
    for index, session in enumerate(sessions):
        problem = _training_problem(session, first)
        if problem is not None:
            return f"session {index}: {problem}"
    return None


def adapters_problem(sessions: Sequence[TrainingSession]) -> str | None:
    """Why one forward of session 0's tree over every session's rows cannot put each
    session's own adapter on its own rows (``row_blocks``), or None: they must share one base
    and run one plain LoRA adapter on the same linear layers. The output head is apart: each
    session's chunks run under its own head (``stacked_head``), with an adapter or without."""
    first = sessions[0]
    if first.shared_base is None:
        return "session 0 runs on a base of its own; only sessions on one shared base run together"
    targets = lora_layers(first.model).keys()
    for index, session in enumerate(sessions):
        problem = _adapter_problem(session, first, targets)
        if problem is not None:
            return f"session {index}: {problem}"
    return None


def _adapter_problem(session: TrainingSession, first: TrainingSession, targets) -> str | None:
    if session.shared_base is not first.shared_base:
        return "it runs on another base than session 0"
    problem = _setup_problem(session)
    if problem is None and lora_layers(session.model).keys() != targets:
        return "its LoRA layers are on other modules than session 0's"
    return problem


def _training_problem(session: TrainingSession, first: TrainingSession) -> str | None:
    """What a training pass needs beyond the adapters: one way of running forward and loss."""
    if session.config.gradient_checkpointing != first.config.gradient_checkpointing:
        return "gradient_checkpointing differs from session 0's"
    if session.encoder.logits_chunk_bytes != first.encoder.logits_chunk_bytes:
        return "logits_chunk_bytes differs from session 0's (it decides the head's chunks)"
    if type(session.loss_hook) is not LossHook:
        return f"its loss hook {type(session.loss_hook).__name__} may run its own forward"
    return _draws_problem(session)


# What a session's set up decides never changes: found once per session (walking a module tree
# costs about half a millisecond, and a scheduler asks this of every run it offers a pass).
_SETUP_PROBLEMS: weakref.WeakKeyDictionary[TrainingSession, str | None] = (
    weakref.WeakKeyDictionary()
)
_DRAWS_PROBLEMS: weakref.WeakKeyDictionary[TrainingSession, str | None] = (
    weakref.WeakKeyDictionary()
)


def _draws_problem(session: TrainingSession) -> str | None:
    if session not in _DRAWS_PROBLEMS:
        _DRAWS_PROBLEMS[session] = _find_draws_problem(session)
    return _DRAWS_PROBLEMS[session]


def _find_draws_problem(session: TrainingSession) -> str | None:
    """Whether the session's training forward draws from a generator (a dropout anywhere): a
    shared pass draws once for all, so each session would draw other numbers than alone."""
    lora = session.config.lora
    if lora is not None and lora.dropout:
        return f"LoRA dropout {lora.dropout} draws from the session's generator"
    for name, module in session.model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            return f"{name} is a dropout of p={module.p}"
    if getattr(session.model.config, "attention_dropout", 0.0):
        return "the model's attention dropout draws from the session's generator"
    return None


def _setup_problem(session: TrainingSession) -> str | None:
    if session not in _SETUP_PROBLEMS:
        _SETUP_PROBLEMS[session] = _find_setup_problem(session)
    return _SETUP_PROBLEMS[session]


def _find_setup_problem(session: TrainingSession) -> str | None:
    """Whether the session's tree runs exactly one plain LoRA adapter a forward of another
    session's tree can apply in its place (``row_blocks``)."""
    config, lora = session.config, session.config.lora
    if config.task != "causal-lm":
        return f"task {config.task} (only causal-lm runs together)"
    if lora is None:
        return "a full-weights run trains alone"
    if lora.use_dora:
        return "DoRA adapters run alone"
    if lora.target_parameters:
        return "adapters on parameters (target_parameters) run alone"
    layers = dict(lora_layers(session.model))
    head = head_adapter(session.model)
    if head is not None:
        layers["output head"] = head
    for name, layer in layers.items():
        if len(layer.active_adapters) != 1 or layer.merged or layer.disable_adapters:
            return f"layer {name} does not run exactly one unmerged adapter"
        if layer.lora_variant:
            return f"layer {name} runs a LoRA variant"
    for name, module in session.model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            return f"{name} trains a whole module (modules_to_save)"
    return None


def padded_shape(request: Request) -> tuple[int, int]:
    """(rows, padded width) of the batch the request's session encodes (``Request.microbatch``:
    InvalidArgument where the session refuses it)."""
    return tuple(request.microbatch.model_inputs()[0].shape)


def shape_problem(shapes: Sequence[tuple[int, int]], invariance: RowInvariance) -> str | None:
    """Why batches of these (rows, width) shapes cannot share a pass bit for bit, or None."""
    widths = sorted({width for _, width in shapes})
    if len(widths) > 1:
        return (
            f"padded widths differ ({', '.join(map(str, widths))}): padding to a common width "
            "changes the attention's bits; group requests of one width"
        )
    return invariance.problem([rows * width for rows, width in shapes])
