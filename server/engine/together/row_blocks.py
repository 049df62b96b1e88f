"""One forward of a base model over many sessions' rows, each row block under its own adapter.

Sessions on one ``SharedBase`` each hold their own module tree, wrapped in their own PEFT
adapter, on the same base tensors. A shared pass runs ONE of those trees (the leader's) over the
rows of every session stacked along the batch dimension; while it runs, each of the leader's LoRA
linear layers computes its base layer once over all the rows and then adds, to each session's row
block, that session's own adapter: the LoRA layer of the same name in that session's tree, with
PEFT's own arithmetic (``lora_B(lora_A(dropout(x))) * scaling`` added to the base output, cast
back to its dtype). Where a linear layer gives a row the same bits alone and stacked
(``row_invariance``), each block's output is bit for bit what that session's own forward gives.

The output head is left as it is here: the chunked logprobs (``loss.chunked_logprobs``) hand it
zero positions in the model's forward, and ``stacked_head`` runs the base's head over stacks of
chunks, each chunk under its own session's head (``by_row_block``). A decode step, which reads
the head's output from the model's forward, puts each block under its own head adapter with
``heads_by_row_block``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear

from trainwire.server.errors import FailedPrecondition

# A session's module tree never changes after set up, and walking it costs milliseconds a pass.
_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, LoraLinear]] = (
    weakref.WeakKeyDictionary()
)


def head_adapter(model: torch.nn.Module) -> LoraLinear | None:
    """The model's output head when it carries a LoRA adapter (as Tinker's ``train_unembed``
    makes it), else None."""
    head = model.get_output_embeddings()
    return head if isinstance(head, LoraLinear) else None


def base_layer(module: torch.nn.Module) -> torch.nn.Module:
    """The base linear a LoRA layer wraps, or the module itself where it carries no adapter."""
    return module.base_layer if isinstance(module, LoraLinear) else module


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLinear]:
    """The model's LoRA linear layers by module name, its output head left out."""
    if model not in _LAYERS:
        head = model.get_output_embeddings()
        _LAYERS[model] = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, LoraLinear) and module is not head
        }
    return _LAYERS[model]


@contextlib.contextmanager
def adapters_by_row_block(models: Sequence[torch.nn.Module], rows: Sequence[int]) -> Iterator[None]:
    """While inside, a forward of ``models[0]`` over stacked rows applies ``models[i]``'s
    adapter to the ``i``-th block of ``rows[i]`` rows (along dimension 0).

    Every model must have LoRA linear layers of the same names. Held through the backward too:
    gradient checkpointing runs the forward again there.
    """
    leader = lora_layers(models[0])
    owners = [lora_layers(model) for model in models]
    for index, layers in enumerate(owners):
        if layers.keys() != leader.keys():
            raise FailedPrecondition(
                f"session {index} has LoRA layers on other modules than session 0; a shared pass "
                "needs the same adapter targets"
            )
    for name, layer in leader.items():
        adapters = [row_adapter(layers[name]) for layers in owners]
        layer.forward = functools.partial(by_row_block, layer.base_layer, adapters, tuple(rows))
    try:
        yield
    finally:
        for layer in leader.values():
            del layer.forward  # the class's own forward again


@dataclass(frozen=True)
class RowAdapter:
    """One LoRA layer's adapter as a pass adds it to a block of rows taken as a matrix
    (positions by features): PEFT's ``Linear.forward`` after its base layer, for a plain (not
    DoRA) active adapter. A pass calls it for every block of every layer (a hundred times over
    in a small model), where PEFT's module lookups and calls cost more than the products
    themselves, so a layer's modules and settings are looked up once (``row_adapter`` keeps
    them: a session's adapter never changes after set up). Each product is the call
    ``nn.Linear`` makes (``F.linear``: for a matrix, ``mm`` or ``addmm`` of the transposed
    weight), so the bits are PEFT's."""

    lora_A: torch.nn.Module
    lora_B: torch.nn.Module
    dropout: torch.nn.Module | None  # None: PEFT's identity (no dropout)
    scaling: float
    cast_input: bool

    def __call__(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        result_dtype = result.dtype
        weight_A = self.lora_A.weight
        if self.cast_input and x.dtype != weight_A.dtype:
            x = x.to(dtype=weight_A.dtype)
        if self.dropout is not None:
            x = self.dropout(x)
        hidden = F.linear(x, weight_A, self.lora_A.bias)
        update = F.linear(hidden, self.lora_B.weight, self.lora_B.bias) * self.scaling
        return (result + update).to(result_dtype)


# Each LoRA layer's ``RowAdapter``, made at its first pass.
_ADAPTERS: weakref.WeakKeyDictionary[LoraLinear, RowAdapter] = weakref.WeakKeyDictionary()


def row_adapter(module: torch.nn.Module) -> RowAdapter | None:
    """What ``module`` adds to its rows after its base layer: its active LoRA adapter, or
    None where it carries none."""
    if not isinstance(module, LoraLinear):
        return None
    adapter = _ADAPTERS.get(module)
    if adapter is None:
        (name,) = module.active_adapters
        dropout = module.lora_dropout[name]
        adapter = RowAdapter(
            lora_A=module.lora_A[name],
            lora_B=module.lora_B[name],
            dropout=None if isinstance(dropout, torch.nn.Identity) else dropout,
            scaling=module.scaling[name],
            cast_input=getattr(module, "cast_input_dtype_enabled", True),
        )
        _ADAPTERS[module] = adapter
    return adapter


def by_row_block(
    base: Callable[[torch.Tensor], torch.Tensor],
    adapters: Sequence[RowAdapter | None],
    rows: Sequence[int],
    x: torch.Tensor,
) -> torch.Tensor:
    """``base`` once over every row of ``x``, then to the ``i``-th block of ``rows[i]`` rows
    ``adapters[i]`` (nothing, where it is None): each block's rows as that adapter's layer gives
    them alone, where ``base`` gives a row the same bits alone and stacked."""
    # The base output is split, not sliced, and the rows too: each split's backward is one
    # concatenation, so the input's gradient gathers the same terms as alone, with no zeros
    # added in between. The blocks are taken as matrices (positions by features): a layer alone
    # folds its input to that matrix for its product anyway (``torch.matmul``), so each product
    # is the same call on the same numbers, and the backward walks two nodes a product fewer
    # (a pass has one block per run per layer: its nodes are most of a small model's backward).
    result = base(x)
    positions = math.prod(x.shape[1:-1])  # a row's positions (1 for a matrix of rows)
    flat_x = x.reshape(-1, x.shape[-1])
    flat_result = result.reshape(-1, result.shape[-1])
    sizes = [count * positions for count in rows]
    pieces = [
        base_block if adapter is None else adapter(x_block, base_block)
        for adapter, x_block, base_block in zip(
            adapters, flat_x.split(sizes), flat_result.split(sizes), strict=True
        )
    ]
    return torch.cat(pieces).view(result.shape)


@contextlib.contextmanager
def heads_by_row_block(models: Sequence[torch.nn.Module], rows: Sequence[int]) -> Iterator[None]:
    """While inside, ``models[0]``'s output head, called on stacked rows (as a decode step's
    forward calls it), gives the ``i``-th block of ``rows[i]`` rows the base's head and
    ``models[i]``'s head adapter where it carries one (the base's head alone where it does
    not, as that model's own head gives it). Not for the training pass: its head runs apart
    (``stacked_head``)."""
    heads = [model.get_output_embeddings() for model in models]
    if not any(isinstance(head, LoraLinear) for head in heads):
        yield
        return
    leader = heads[0]
    if isinstance(leader, LoraLinear):
        base = leader.base_layer
    else:  # the class's own forward: the instance's, replaced below, would call itself
        base = functools.partial(type(leader).forward, leader)
    adapters = [row_adapter(head) for head in heads]
    leader.forward = functools.partial(by_row_block, base, adapters, tuple(rows))
    try:
        yield
    finally:
        del leader.forward  # the class's own forward again
