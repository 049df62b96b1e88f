"""A native model directory's tensors in the layout the live model keeps in memory.

Why: transformers 5 keeps some weights in memory in another layout than on disk. A Qwen3-MoE's
experts are one fused tensor per layer (``mlp.experts.gate_up_proj``) in memory and one tensor per
expert and projection in its files; ``from_pretrained`` converts on the way in and
``save_pretrained`` converts back on the way out. Hub checkpoints may name a weight as
transformers still accepts it (``LayerNorm.gamma`` for ``LayerNorm.weight``), and a base model's
files may lack or add the ``base_model_prefix``. So a
``load_weights`` that matched file names literally against live names could not load an MoE
export back, nor seed a run from any hub MoE checkpoint.

Here the source goes through the very mapping ``from_pretrained`` uses for this model
(``get_model_conversion_mapping`` and its renamings and converters), entirely on the source's
tensors: nothing live is touched, and the caller checks names, shapes and dtypes of the result
before it copies anything. Dtypes are kept as the files hold them (``from_pretrained`` would cast;
a load here refuses another dtype instead, never a silent conversion).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from trainwire.server.errors import InvalidArgument


def transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (or ``model`` itself when not wrapped)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def tied_aliases(model: torch.nn.Module, native_name) -> dict[str, str]:
    """Second names of shared parameters (a tied ``lm_head.weight``), each to its first name.

    ``named_parameters`` lists a tied parameter once; a checkpoint may still hold it under both
    names, as ``from_pretrained`` accepts.
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        native = native_name(name)
        if native is None:
            continue
        if id(parameter) in first and first[id(parameter)] != native:
            aliases[native] = first[id(parameter)]
        first.setdefault(id(parameter), native)
    return aliases


def in_live_layout(
    model: torch.nn.Module,
    source: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """``source`` renamed and converted as ``from_pretrained`` would for ``model``.

    ``expected`` maps the live native names to their parameters (prefix decisions look at it).
    A tensor no rule maps onto an expected name keeps its file name, so the caller's check
    reports it as unexpected by the name the user can find in the files. A tied alias is dropped
    where its first name is present too (``from_pretrained`` ties the two), else it stands in
    for it. A source that a conversion cannot combine (experts of unequal shapes, say) is
    ``InvalidArgument``.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    hf_model = transformers_model(model)
    mapping = get_model_conversion_mapping(hf_model)
    renamings = [rule for rule in mapping if isinstance(rule, WeightRenaming)]
    converters = [rule for rule in mapping if isinstance(rule, WeightConverter)]
    by_pattern = {pattern: rule for rule in converters for pattern in rule.source_patterns}
    prefix = hf_model.base_model_prefix or None

    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}  # each result's file name, to name a weight given twice
    pending: dict[str, WeightConverter] = {}
    merged_from: dict[str, str] = {}  # a converted weight's first file name
    # Checked on each input: stacking experts would promote a stray dtype without a word.
    problems: list[str] = []

    def put(name: str, tensor: torch.Tensor, key: str) -> None:
        if name in origin:
            problems.append(f"{name}: given twice, as {origin[name]} and as {key}")
        out[name], origin[name] = tensor, key

    # In the library's order: experts are stacked in the order their tensors arrive.
    for key in sorted(source, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:
            renamed, pattern = key, None
        if renamed not in expected:
            put(key, source[key], key)
        elif pattern is None:
            put(renamed, source[key], key)
        else:
            if source[key].dtype != expected[renamed].dtype:
                problems.append(
                    f"{key}: dtype {source[key].dtype}, model has {expected[renamed].dtype}"
                )
            rule = pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern]))
            rule.add_tensor(renamed, key, pattern, source[key])
            merged_from.setdefault(renamed, key)
    if not problems:
        for first_name, rule in pending.items():
            for name, tensor in _converted(rule, first_name, hf_model).items():
                put(name, tensor, f"{merged_from[first_name]} and the tensors merged with it")
    if problems:
        raise InvalidArgument(f"the weights do not fit this model: {'; '.join(problems[:10])}")
    return _resolve_aliases(out, aliases or {})


def _converted(rule, first_name: str, hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    try:
        realized = rule.convert(first_name, model=hf_model, config=hf_model.config)
    except (RuntimeError, ValueError, IndexError, KeyError) as error:
        raise InvalidArgument(
            f"the weights do not fit this model: {first_name} cannot be assembled from the "
            f"files' tensors ({error})"
        ) from None
    return {
        name: value[0] if isinstance(value, list) else value for name, value in realized.items()
    }


def _resolve_aliases(
    tensors: dict[str, torch.Tensor], aliases: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    for alias, first in aliases.items():
        if alias not in tensors:
            continue
        tensor = tensors.pop(alias)
        tensors.setdefault(first, tensor)
    return tensors
