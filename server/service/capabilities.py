"""What the engine can do that a transport describes or asks for by name: the losses it trains
with (and those it refuses, with why), and the layers each LoRA role names in a base model.

Calls go one way, transport -> service -> engine, so a transport asks here rather than reading
the engine's tables itself. Naming a role's layers builds the base model's skeleton on the meta
device from its ``config.json`` (no weights read, the generators put back under the engine's
lock): engine work, done where the engine is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainwire.server.engine.loss.losses import LOSSES, NOT_SERVED
from trainwire.server.engine.weights.module_roles import ROLES, RoleTargets, model_role_targets

LORA_ROLES: tuple[str, ...] = ROLES  # what a LoRA switch may name: attention, MLP, unembedding


def served_losses() -> list[str]:
    """The losses a ``forward_backward`` may name, sorted."""
    return sorted(LOSSES)


def refused_losses() -> dict[str, str]:
    """Losses a Tinker recipe may name that this server refuses, each with why and what to
    train with instead."""
    return dict(NOT_SERVED)


def lora_role_targets(model_dir: Path, roles: Sequence[str]) -> RoleTargets:
    """PEFT targets (``modules``, ``parameters``) for ``roles`` of the causal LM in
    ``model_dir``; InvalidArgument naming the architecture for a role that matches nothing there,
    or for a model whose architecture cannot be read."""
    return model_role_targets(model_dir, roles)
