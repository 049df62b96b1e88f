"""One base model in memory, lent to many LoRA sessions (``TrainingSession(..., base=...)``).

N LoRA runs on one base model need its weights once, not N times: the base is loaded once, and
each session gets its own instance of the model (``instance``) whose parameters and buffers are
new tensor objects on the SAME storage as the loaded copy, built by ``copy.deepcopy`` with those
tensors in its memo. Everything else (the module tree, its config, its training mode, hooks) is
the session's own, so ``load_session_model`` wraps the instance in the session's adapter exactly
as it wraps a freshly loaded model, under the session's RNG: a session on a shared base draws the
same LoRA initialization, and gives the same losses, digest and exports, as the same session
loaded alone. That holds because loading draws nothing from the RNG (checked here: a model whose
directory lacks weights that ``from_pretrained`` then initializes at random, a new
classification head say, would give each run its own, so it is refused).

No session writes the shared weights: PEFT freezes them (each session's own Parameter objects),
and every operation that would copy weights in keeps only the session's own tensors
(``own_part``): a source that carries the base's exact bits (a checkpoint of a run on this base)
loads its adapter, and one that carries other base weights is refused. The state digest still
hashes every parameter, base included, so it stays what it is for the same session alone.

Lifetime is plain reference counting: a session holds its ``SharedBase``, and its base tensors
are views of the base's storage. Dropping a session frees its adapter, optimizer state and
gradients; the storage goes when the last tensor on it goes (the ``SharedBase``'s and every
session's), so the base lives as long as any holder keeps it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from trainwire.contract.config import LoraSettings, TrainingConfig
from trainwire.server.engine.device import resolve_device, resolve_dtype
from trainwire.server.engine.session.rng import RngState, preserved_global_rng
from trainwire.server.engine.weights.model_loading import (
    load_model,
    load_tokenizer,
    resolve_model_dir,
)
from trainwire.server.engine.weights.transfer import Pairs
from trainwire.server.errors import FailedPrecondition, InvalidArgument


class SharedBase:
    """A base model loaded once on ``device``, whose weights LoRA sessions share.

    ``config`` names what is loaded: its ``model`` (resolved under ``model_root``), ``task``,
    ``labels`` and ``precision``; its other settings are each session's own. A session on this
    base must agree on all of those, train LoRA, and run in this process alone (no group).
    """

    def __init__(
        self,
        config: TrainingConfig,
        *,
        device: str | torch.device | None = None,
        model_root: str | Path | None = None,
    ) -> None:
        if not isinstance(config, TrainingConfig):
            raise InvalidArgument(f"config must be a TrainingConfig, got {type(config).__name__}")
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(config, self.device)
        self.model_dir = resolve_model_dir(config, None if model_root is None else Path(model_root))
        with preserved_global_rng():  # the caller's generators stay as they were
            RngState.seeded(0, cuda=False).install()
            before = torch.get_rng_state()
            model = load_model(config, self.model_dir, self.dtype, load_tokenizer(self.model_dir))
            drew = not torch.equal(before, torch.get_rng_state())
        if drew:
            raise InvalidArgument(
                f"model {config.model!r} cannot be a shared base: loading it for "
                f"{config.task} initializes weights its directory lacks at random, so each run "
                "would need its own; open such runs on their own"
            )
        self._model = model.to(self.device)
        self._storages = {_storage(t) for t in self._tensors()}
        self._fingerprints: dict[LoraSettings, str | None] = {}

    def _tensors(self) -> Iterable[torch.Tensor]:
        yield from self._model.parameters()
        yield from self._model.buffers()

    def instance(self) -> torch.nn.Module:
        """A model of its own for one session, its weights on the base's storage (not copied)."""
        return self.copy_sharing(self._model)

    def copy_sharing(self, model: torch.nn.Module) -> torch.nn.Module:
        """A deep copy of ``model`` whose tensors on the shared storage stay on it (new tensor
        objects, not new storage); everything else is copied."""
        memo: dict[int, object] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            if not self.holds(tensor):
                continue
            if isinstance(tensor, torch.nn.Parameter):
                memo[id(tensor)] = torch.nn.Parameter(
                    tensor.detach(), requires_grad=tensor.requires_grad
                )
            else:
                memo[id(tensor)] = tensor.detach()
        return copy.deepcopy(model, memo)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies on the shared weights' storage."""
        return _storage(tensor) in self._storages

    def refuse_unfit(self, config: TrainingConfig, model_dir: Path, device: torch.device) -> None:
        """InvalidArgument naming why a session with ``config`` cannot run on this base."""
        if config.lora is None:
            raise InvalidArgument(
                "a full-weights run cannot share a base model: it trains the base weights that "
                "the other runs on it read; open it without a shared base (it trains alone)"
            )
        problems = []
        if model_dir != self.model_dir:
            problems.append(
                f"model {config.model!r} is not this base's model {self.config.model!r}"
            )
        for key in ("task", "labels", "precision"):
            now, base = getattr(config, key), getattr(self.config, key)
            if now != base:
                problems.append(f"{key} {now!r} is not this base's {base!r}")
        if device != self.device:
            problems.append(f"device {device} is not this base's {self.device}")
        if problems:
            raise InvalidArgument("the run does not fit the shared base: " + "; ".join(problems))

    def base_fingerprint(
        self, config: TrainingConfig, compute: Callable[[], str | None]
    ) -> str | None:
        """The base model fingerprint of a session with ``config``, hashed once per LoRA
        setting (the only thing that changes how PEFT wraps, and so names, the same tensors)."""
        assert config.lora is not None
        if config.lora not in self._fingerprints:
            self._fingerprints[config.lora] = compute()
        return self._fingerprints[config.lora]

    def own_part(self, pairs: Pairs, what: str) -> Pairs:
        """The pairs of a load that write a session's own tensors. A pair that would write the
        shared weights must carry their exact bits (the load then leaves them as they are);
        other bits are FailedPrecondition, checked before anything is copied."""
        own, differ = [], 0
        for live, source in pairs:
            if not self.holds(live):
                own.append((live, source))
            elif not torch.equal(live, source.to(live.device)):
                differ += 1
        if differ:
            raise FailedPrecondition(
                f"{what} holds other base weights than the shared base model "
                f"{self.config.model!r} ({differ} tensor(s) differ); runs on a shared base never "
                "change it. Load a LoRA adapter or a checkpoint of a run on this base, or open a "
                "run of its own for those weights"
            )
        return own


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())
