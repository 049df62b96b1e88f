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
import weakref
from collections.abc import Iterator, Sequence

import torch
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
        blocks = [layers[name] for layers in owners]
        layer.forward = functools.partial(by_row_block, layer.base_layer, blocks, tuple(rows))
    try:
        yield
    finally:
        for layer in leader.values():
            del layer.forward  # the class's own forward again


def by_row_block(
    base: torch.nn.Module,
    owners: Sequence[torch.nn.Module],
    rows: Sequence[int],
    x: torch.Tensor,
) -> torch.Tensor:
    """``base`` once over every row of ``x``, then to the ``i``-th block of ``rows[i]`` rows
    the adapter of ``owners[i]`` as that LoRA layer adds it alone (nothing, where ``owners[i]``
    carries none): each block's rows as ``owners[i]`` gives them, where ``base`` gives a row the
    same bits alone and stacked."""
    # The base output is split, not sliced, and the rows too: each split's backward is one
    # concatenation, so the input's gradient gathers the same terms as alone, with no zeros
    # added in between.
    result = base(x)
    pieces = [
        _with_adapter(own, x_block, base_block) if isinstance(own, LoraLinear) else base_block
        for own, x_block, base_block in zip(owners, x.split(rows), result.split(rows), strict=True)
    ]
    return torch.cat(pieces)


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
    leader.forward = functools.partial(by_row_block, base, heads, tuple(rows))
    try:
        yield
    finally:
        del leader.forward  # the class's own forward again


def _with_adapter(layer: LoraLinear, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """PEFT's ``Linear.forward`` after its base layer, for a plain (not DoRA) active adapter."""
    result_dtype = result.dtype
    (adapter,) = layer.active_adapters
    lora_A, lora_B = layer.lora_A[adapter], layer.lora_B[adapter]
    x = layer._cast_input_dtype(x, lora_A.weight.dtype)
    result = result + lora_B(lora_A(layer.lora_dropout[adapter](x))) * layer.scaling[adapter]
    return result.to(result_dtype)
