"""Which weights of a model play which role: attention, MLP, unembedding.

Why: "adapt the attention" names a role, not module names. Llama calls its attention projections
``q_proj`` ... ``o_proj``, GPT-2 ``c_attn`` and ``attn.c_proj`` (and its MLP ``c_fc`` and
``mlp.c_proj``), Phi-3 fuses ``qkv_proj``, and a mixture of experts keeps its MLP weights as
parameters (``experts.gate_up_proj``) that no ``nn.Linear`` name reaches. So each adaptable layer
is given the role of the nearest enclosing block that names one (``...Attention`` is attention,
``...MLP`` or ``...Experts`` is the MLP), the output embeddings are the unembedding, and expert
weights (3-d parameters of an ``...Experts`` module) are MLP parameters, for PEFT's
``target_parameters``.

The result is written as PEFT target names: the shortest name suffix that matches only modules (or
parameters) of the chosen roles, so a Llama gets the familiar ``q_proj`` ... ``lm_head``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainwire.server.errors import InvalidArgument

if TYPE_CHECKING:  # torch is imported only where a model is read
    import torch

ATTENTION, MLP, UNEMBED = "attn", "mlp", "unembed"
ROLES = (ATTENTION, MLP, UNEMBED)
# By the class name of an enclosing block, the nearest one that matches deciding. BERT-style
# encoders have no MLP block: their feed-forward is ``...Intermediate`` and ``...Output`` (the
# attention's own output is ``...SelfOutput``, inside the ``...Attention`` block).
ROLE_PATTERNS = (
    (ATTENTION, re.compile(r"Attention")),
    (
        MLP,
        re.compile(r"MLP|Mlp|FeedForward|Experts|SparseMoe|Moe|MoE|Intermediate|(?<!Self)Output$"),
    ),
)
EXPERTS_PATTERN = re.compile(r"Experts$")


@dataclass(frozen=True)
class RoleTargets:
    """PEFT target names for some roles: ``modules`` for ``target_modules``, ``parameters`` for
    ``target_parameters``."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...]


def adaptable_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every layer PEFT's LoRA adapts by module name: linear layers and GPT-2's ``Conv1D``."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D))
    }


def role_members(model: torch.nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """Each role's module names and parameter names in ``model``, in model order."""
    modules = dict(model.named_modules())
    members: dict[str, tuple[list[str], list[str]]] = {role: ([], []) for role in ROLES}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, layer in adaptable_layers(model).items():
        role = UNEMBED if layer is output else _enclosing_role(name, modules)
        if role is not None:
            members[role][0].append(name)
    for module_name, module in modules.items():
        if not EXPERTS_PATTERN.search(type(module).__name__):
            continue
        for param_name, parameter in module.named_parameters(recurse=False):
            if parameter.ndim == 3:  # one matrix per expert; biases and routers stay frozen
                members[MLP][1].append(f"{module_name}.{param_name}")
    return members


def _enclosing_role(name: str, modules: dict[str, torch.nn.Module]) -> str | None:
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        block = type(modules[".".join(parts[:depth])]).__name__
        for role, pattern in ROLE_PATTERNS:
            if pattern.search(block):
                return role
    return None


def holds_experts(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds a mixture of experts (transformers' ``...Experts`` modules)."""
    return any(EXPERTS_PATTERN.search(type(module).__name__) for module in model.modules())


def role_targets(model: torch.nn.Module, roles: Sequence[str]) -> RoleTargets:
    """PEFT targets for ``roles`` of ``model``; ValueError naming the architecture for a role
    that matches nothing in it."""
    members = role_members(model)
    architecture = type(model).__name__
    empty = [role for role in roles if not any(members[role])]
    if empty:
        raise ValueError(
            "; ".join(f"train_{role} matches no {role} layer of {architecture}" for role in empty)
        )
    chosen_modules = [name for role in roles for name in members[role][0]]
    chosen_parameters = [name for role in roles for name in members[role][1]]
    return RoleTargets(
        modules=shortest_suffixes(chosen_modules, [name for name, _ in model.named_modules()]),
        parameters=shortest_suffixes(
            chosen_parameters, [name for name, _ in model.named_parameters()]
        ),
    )


def shortest_suffixes(chosen: Sequence[str], every: Iterable[str]) -> tuple[str, ...]:
    """Names that match (as PEFT matches: equal, or ending in ``.name``) exactly ``chosen`` among
    ``every``: for each chosen name, its shortest dotted suffix that matches nothing else."""
    chosen_set, every = set(chosen), list(every)
    out: dict[str, None] = {}
    for name in chosen:
        parts = name.split(".")
        for length in range(1, len(parts) + 1):
            suffix = ".".join(parts[-length:])
            matched = {n for n in every if n == suffix or n.endswith("." + suffix)}
            if matched <= chosen_set:
                out.setdefault(suffix)
                break
    return tuple(out)


def model_role_targets(model_dir: Path, roles: Sequence[str]) -> RoleTargets:
    """``role_targets`` for the causal LM in ``model_dir``, read from its ``config.json`` alone:
    the model is built on the meta device (no weights read, no memory), the generators put back
    as they were (taking turns with sessions on other threads: ``preserved_global_rng``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainwire.server.engine.session.rng import preserved_global_rng

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        with preserved_global_rng(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidArgument(
            f"model {model_dir.name!r}: cannot read its architecture to choose LoRA layers "
            f"({error})"
        ) from None
    try:
        return role_targets(model, roles)
    except ValueError as error:
        raise InvalidArgument(f"lora_config: {error}") from None
