"""Tiny real Hugging Face models with real tokenizers, built offline in tens of milliseconds.

Why: trainwire drives Hugging Face models, and the only honest test of that is a real model with a
real tokenizer that ``transformers`` loads from a directory; downloading one is not an option (the
tests and the demo run without a network), and a mock would hide exactly the loading, padding and
saving details that break in practice. So :func:`make_tiny_model` trains a small tokenizer on a
bundled English corpus and writes a freshly initialized model of about 200 kB.

The output depends only on the arguments (byte-identical files in any directory, process or run),
the caller's torch RNG is untouched, and attention is ``eager`` so CPU fp32 repeats bit for bit.
torch, tokenizers and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire.contract.config import TASKS, is_int

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

ARCHS = ("llama", "bert")
CORPUS_FILE = "corpus.txt"
CONFIG_FILE = "config.json"
MAX_POSITIONS = 256
ATTN_IMPLEMENTATION = "eager"  # eager attention repeats bit for bit on CPU; sdpa may not

LLAMA_VOCAB_SIZE = 500
BERT_BPE_VOCAB_SIZE = 380  # the WordPiece vocabulary adds every character twice (c and ##c)
LLAMA_SPECIALS = {
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
}
BERT_SPECIALS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
WORD_START = "▁"  # marks a word's first piece while the BERT vocabulary is trained

# Both architectures share each shape; llama adds grouped-query attention (2 kv heads).
# "tiny" is for tests; "small" (4 layers x 256 hidden) gives the benchmarks real work to time.
SHAPES = {
    "tiny": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": MAX_POSITIONS,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 688,
        "max_position_embeddings": MAX_POSITIONS,
    },
}
LLAMA_KV_HEADS = 2


def make_tiny_model(
    directory: str | Path,
    *,
    task: str = "causal-lm",
    arch: str = "llama",
    labels: Sequence[str] = (),
    seed: int = 0,
    shards: int | None = None,
    size: str = "tiny",
) -> Path:
    """Write a tiny real model and its tokenizer into ``directory`` and return it as a Path.

    Args:
        directory: where to write; created if needed. Existing weight files there are replaced.
        task: ``causal-lm`` or ``sequence-classification``.
        arch: ``llama`` (both tasks) or ``bert`` (classification only).
        labels: the class names, in order, for ``sequence-classification`` (at least 2); they
            become ``id2label``/``label2id``. Must be empty for ``causal-lm``.
        seed: initializes the weights; the caller's global torch RNG is not touched.
        shards: with N > 1, the safetensors are split into N shards (fewer only if the model has
            fewer tensors) plus ``model.safetensors.index.json``; None or 1 writes one
            ``model.safetensors``.
        size: ``tiny`` (tests) or ``small`` (4 layers x 256 hidden, for benchmarks).

    Returns:
        ``directory`` as a Path, loadable with ``AutoTokenizer`` and ``AutoModelForCausalLM`` or
        ``AutoModelForSequenceClassification``.

    Raises:
        ValueError: listing every problem with the arguments, before anything is written.
    """
    labels = _validate_model_args(task, arch, labels, seed, shards)
    if size not in SHAPES:
        raise ValueError(f"make_tiny_model: unknown size {size!r}: use one of {', '.join(SHAPES)}")
    out = Path(directory)
    tokenizer = _pretrained_tokenizer(arch)
    config = _model_config(arch, task, labels, tokenizer, SHAPES[size])
    model = _init_model(config, task, seed)
    out.mkdir(parents=True, exist_ok=True)
    _save_model(model, out, shards)
    tokenizer.save_pretrained(out)
    return out


def _validate_model_args(
    task: Any, arch: Any, labels: Any, seed: Any, shards: Any
) -> tuple[str, ...]:
    """Check every argument and report all problems at once; return the labels as a tuple."""
    problems = []
    if arch not in ARCHS:
        problems.append(f"unknown arch {arch!r}: use one of {', '.join(ARCHS)}")
    if task not in TASKS:
        problems.append(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    if arch == "bert" and task == "causal-lm":
        problems.append("arch 'bert' has no causal-lm head: use arch 'llama' for causal-lm")
    if (
        isinstance(labels, str)
        or not isinstance(labels, Sequence)
        or not all(isinstance(label, str) and label for label in labels)
    ):
        problems.append("labels must be a sequence of non-empty strings, e.g. ('neg', 'pos')")
        labels = ()
    labels = tuple(labels)
    if len(set(labels)) != len(labels):
        problems.append(f"labels must be unique, got {list(labels)}")
    if task == "causal-lm" and labels:
        problems.append(
            "labels are only for sequence-classification: leave them empty for causal-lm"
        )
    if task == "sequence-classification" and len(labels) < 2:
        problems.append(f"sequence-classification needs at least 2 labels, got {len(labels)}")
    if not is_int(seed) or not 0 <= seed < 2**63:
        problems.append(f"seed must be an integer in [0, 2**63), got {seed!r}")
    if shards is not None and (not is_int(shards) or shards < 1):
        problems.append(f"shards must be None or a positive integer, got {shards!r}")
    if problems:
        raise ValueError("make_tiny_model: " + "; ".join(problems))
    return labels


def _corpus_lines() -> list[str]:
    text = resources.files("trainwire").joinpath("data", CORPUS_FILE).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


@functools.cache
def _tokenizer_json(arch: str) -> str:
    """The trained tokenizer, serialized. Training is deterministic, so caching changes nothing."""
    tokenizer = _train_llama_tokenizer() if arch == "llama" else _train_bert_tokenizer()
    return tokenizer.to_str()


def _train_llama_tokenizer() -> Tokenizer:
    """Byte-level BPE, as Llama 3 uses: any text encodes without unknown tokens and decodes back.

    The byte alphabet is given in full and sorted, so every id, and so every tie between equally
    frequent merges, is the same on every run.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=LLAMA_SPECIALS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=LLAMA_VOCAB_SIZE,
        special_tokens=list(LLAMA_SPECIALS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos = LLAMA_SPECIALS["bos_token"]
    template = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    tokenizer.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), template]
    )
    return tokenizer


def _train_bert_tokenizer() -> Tokenizer:
    """WordPiece with BERT's normalizer, pre-tokenizer and ``[CLS] ... [SEP]`` template.

    The tokenizers WordPieceTrainer numbers the ``##`` pieces in hash-map order, which changes
    from run to run (and so do its merges). Instead a BPE is trained with every word marked by a
    leading ``▁`` (all ids deterministic), and its pieces are renamed: ``▁x`` starts a word
    (``x``), any other piece continues one (``##x``).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    vocab = _bert_vocab(normalizer)
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=BERT_SPECIALS["unk_token"]))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    cls, sep = BERT_SPECIALS["cls_token"], BERT_SPECIALS["sep_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    return tokenizer


def _bert_vocab(normalizer: Any) -> dict[str, int]:
    """Specials, then every character as a word start and as a continuation, then learned pieces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    marker = Tokenizer(models.BPE())
    marker.normalizer = normalizer
    marker.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.BertPreTokenizer(),
            pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always", split=False),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=BERT_BPE_VOCAB_SIZE, show_progress=False)
    marker.train_from_iterator(_corpus_lines(), trainer=trainer)
    learned = sorted(marker.get_vocab().items(), key=lambda item: item[1])
    alphabet = sorted({char for piece, _ in learned for char in piece if char != WORD_START})
    pieces = list(BERT_SPECIALS.values())
    pieces += [piece for char in alphabet for piece in (char, "##" + char)]
    for piece, _ in learned:
        if piece != WORD_START:
            pieces.append(piece[1:] if piece.startswith(WORD_START) else "##" + piece)
    ordered = list(dict.fromkeys(pieces))  # first occurrence wins, order kept
    return {piece: index for index, piece in enumerate(ordered)}


def _pretrained_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    specials = LLAMA_SPECIALS if arch == "llama" else BERT_SPECIALS
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(arch)),
        model_max_length=MAX_POSITIONS,
        padding_side="right",
        **specials,
    )


def _model_config(
    arch: str,
    task: str,
    labels: tuple[str, ...],
    tokenizer: PreTrainedTokenizerFast,
    shape: dict[str, int],
) -> PretrainedConfig:
    from transformers import BertConfig, LlamaConfig

    settings: dict[str, Any] = {
        **shape,
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        settings.update(
            num_key_value_heads=LLAMA_KV_HEADS,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,  # separate head: simpler LoRA targets and exports
        )
    if task == "sequence-classification":
        settings.update(
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: index for index, label in enumerate(labels)},
            problem_type="single_label_classification",
        )
    config_class = LlamaConfig if arch == "llama" else BertConfig
    return config_class(attn_implementation=ATTN_IMPLEMENTATION, **settings)


def _init_model(config: PretrainedConfig, task: str, seed: int) -> PreTrainedModel:
    """Initialize from ``seed`` in a forked RNG, so the caller's random stream is untouched."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    from trainwire.server.engine.session.rng import preserved_global_rng

    with preserved_global_rng():  # taking turns with sessions on other threads
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    return model.eval()


def _save_model(model: PreTrainedModel, directory: Path, shards: int | None) -> None:
    """Save safetensors (sharded by byte size when asked) and record eager attention."""
    max_shard_size: int | str = "50GB"  # transformers' default: one file
    if shards is not None and shards > 1:
        max_shard_size = _shard_size_for(model.state_dict(), shards)
    with _quiet_progress_bars():
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    # transformers keeps the attention choice out of config.json, yet reads the key back:
    # written here, a plain from_pretrained(directory) loads with eager attention too.
    config_path = directory / CONFIG_FILE
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["attn_implementation"] = ATTN_IMPLEMENTATION
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """No progress bar while a tiny model is written ("Writing model shards" on every save, in a
    test's or the demo's output), and the caller's choice back afterwards. Only the bars:
    warnings and log records still show."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def _shard_size_for(state_dict: dict[str, Any], shards: int) -> int:
    """The smallest ``max_shard_size`` (bytes) that splits ``state_dict`` into at most ``shards``.

    Sizes are asked of the splitter that ``save_pretrained`` itself uses. It fills shards in key
    order, so a larger limit never gives more shards, and a bisection finds the smallest limit:
    exactly ``shards`` files whenever the tensor sizes allow it.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    def count(limit: int) -> int:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=limit)
        return len(split.filename_to_tensors)

    low = 1
    high = sum(tensor.numel() * tensor.element_size() for tensor in state_dict.values())
    while low < high:
        middle = (low + high) // 2
        if count(middle) <= shards:
            high = middle
        else:
            low = middle + 1
    return low
