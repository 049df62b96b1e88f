"""trainwire.testing: the tiny offline models every other test stands on are real and repeatable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from trainwire.client import InputExample
from trainwire.testing import (
    SENTIMENT_LABELS,
    make_tiny_model,
    tiny_sentiment_examples,
    tiny_text_examples,
)

TEXTS = ["The movie was good.", "What an awful meal, and the service was terrible!", "12 + 3"]
KINDS = {
    "llama-causal-lm": {"arch": "llama", "task": "causal-lm"},
    "llama-classification": {
        "arch": "llama",
        "task": "sequence-classification",
        "labels": ("negative", "neutral", "positive"),
    },
    "bert-classification": {
        "arch": "bert",
        "task": "sequence-classification",
        "labels": ("positive", "negative"),
    },
}


def file_digests(directory: Path) -> dict[str, str]:
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_llama_causal_lm_loads_with_auto_classes_and_gives_a_finite_loss(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path / "model")
    assert directory == tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (tokenizer.pad_token, tokenizer.unk_token) == ("<pad>", "<unk>")
    assert tokenizer.padding_side == "right"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.tie_word_embeddings is False
    assert model.config._attn_implementation == "eager"

    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert batch["input_ids"][:, 0].tolist() == [tokenizer.bos_token_id] * len(TEXTS)
    assert tokenizer.decode(batch["input_ids"][1], skip_special_tokens=True) == TEXTS[1]
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize("kind", ["llama-classification", "bert-classification"])
def test_classification_loads_with_auto_classes_and_gives_a_finite_loss(
    tmp_path: Path, kind: str
) -> None:
    labels = KINDS[kind]["labels"]
    directory = make_tiny_model(tmp_path, **KINDS[kind])
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory)

    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert model.config.num_labels == len(labels)
    assert model.config.id2label == dict(enumerate(labels))
    assert model.config.label2id == {label: index for index, label in enumerate(labels)}
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert model.config._attn_implementation == "eager"

    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(dim=1).tolist() != [batch["input_ids"].shape[1]] * 3
    with torch.no_grad():
        output = model(**batch, labels=torch.tensor([0, 1, 1]))
    assert output.logits.shape == (len(TEXTS), len(labels))
    assert torch.isfinite(output.loss)
    # Padding is invisible (the pad token id is configured, padded positions are masked). At the
    # batch's shape that is bit for bit: a row scores the same whatever the other rows hold.
    length = batch["input_ids"].shape[1]
    for row, text in enumerate(TEXTS):
        others = [text if index == row else TEXTS[row - 1] for index in range(len(TEXTS))]
        shaped = tokenizer(others, padding="max_length", max_length=length, return_tensors="pt")
        with torch.no_grad():
            assert torch.equal(model(**shaped).logits[row], output.logits[row])
            alone = model(**tokenizer([text], return_tensors="pt")).logits[0]
        # Alone, the text is a matrix of another shape, and CPU matmul kernels are chosen by shape:
        # the sums run in another order and the last bits differ (measured: up to 1.5e-8), as
        # DESIGN says of a padded batch. A leak of padding would differ by orders more.
        torch.testing.assert_close(output.logits[row], alone, rtol=0, atol=1e-6)


def test_bert_tokenizer_wraps_text_in_cls_and_sep(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        make_tiny_model(tmp_path, **KINDS["bert-classification"])
    )
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("A great film!")["input_ids"])
    assert tokens[0] == "[CLS]"
    assert tokens[-1] == "[SEP]"
    assert "[UNK]" not in tokens
    assert (tokenizer.pad_token, tokenizer.mask_token) == ("[PAD]", "[MASK]")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_same_arguments_write_byte_identical_files(tmp_path: Path, kind: str) -> None:
    first = file_digests(make_tiny_model(tmp_path / "first", **KINDS[kind], seed=7))
    second = file_digests(make_tiny_model(tmp_path / "second", **KINDS[kind], seed=7))
    assert first == second
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first)


def test_another_process_writes_the_same_bytes_offline(tmp_path: Path) -> None:
    here = make_tiny_model(tmp_path / "here", **KINDS["bert-classification"], shards=2)
    there = tmp_path / "there"
    script = (
        "import sys; from trainwire.testing import make_tiny_model; "
        "make_tiny_model(sys.argv[1], arch='bert', task='sequence-classification', "
        "labels=('positive', 'negative'), shards=2)"
    )
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "12345"}
    subprocess.run(
        [sys.executable, "-c", script, str(there)], check=True, env={**os.environ, **offline}
    )
    assert file_digests(there) == file_digests(here)


def test_a_different_seed_gives_different_weights_and_the_same_tokenizer(tmp_path: Path) -> None:
    zero = file_digests(make_tiny_model(tmp_path / "zero", seed=0))
    one = file_digests(make_tiny_model(tmp_path / "one", seed=1))
    assert zero["model.safetensors"] != one["model.safetensors"]
    assert zero["tokenizer.json"] == one["tokenizer.json"]
    assert zero["config.json"] == one["config.json"]


def test_the_callers_torch_rng_is_untouched(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    make_tiny_model(tmp_path, seed=99)
    assert torch.equal(torch.rand(4), expected)


def test_shards_write_an_index_and_load_with_the_same_logits(tmp_path: Path) -> None:
    whole = make_tiny_model(tmp_path / "whole", seed=3)
    sharded = make_tiny_model(tmp_path / "sharded", seed=3, shards=2)

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert shard_files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (sharded / "model.safetensors").exists()

    tokenizer = AutoTokenizer.from_pretrained(sharded)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        whole_logits = AutoModelForCausalLM.from_pretrained(whole)(**batch).logits
        sharded_logits = AutoModelForCausalLM.from_pretrained(sharded)(**batch).logits
    assert torch.equal(whole_logits, sharded_logits)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"arch": "gpt2"}, "unknown arch 'gpt2'"),
        ({"task": "translation"}, "unknown task 'translation'"),
        ({"arch": "bert"}, "arch 'bert' has no causal-lm head"),
        ({"labels": ("a", "b")}, "labels are only for sequence-classification"),
        ({"task": "sequence-classification"}, "needs at least 2 labels, got 0"),
        ({"task": "sequence-classification", "labels": ("only",)}, "at least 2 labels, got 1"),
        ({"task": "sequence-classification", "labels": ("a", "a")}, "labels must be unique"),
        ({"task": "sequence-classification", "labels": "ab"}, "sequence of non-empty strings"),
        ({"seed": -1}, "seed must be an integer"),
        ({"shards": 0}, "shards must be None or a positive integer"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, arguments: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path / "model", **arguments)
    assert not (tmp_path / "model").exists()


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown arch 'gpt2'.*unknown task 'chat'"):
        make_tiny_model(tmp_path, arch="gpt2", task="chat")


def test_sentiment_examples_are_deterministic_balanced_and_decided_by_their_words() -> None:
    examples = tiny_sentiment_examples(40, seed=5)
    assert examples == tiny_sentiment_examples(40, seed=5)
    assert examples != tiny_sentiment_examples(40, seed=6)
    assert all(isinstance(example, InputExample) for example in examples)
    labels = [example.label for example in examples]
    assert labels.count("positive") == labels.count("negative") == 20
    assert set(labels) == set(SENTIMENT_LABELS)
    for example in examples:
        words = set(example.text.lower().replace(",", " ").replace(".", " ").split())
        has_positive = bool(words & {"good", "great", "excellent", "wonderful", "lovely", "happy"})
        has_negative = bool(words & {"bad", "awful", "terrible", "sad", "poor", "boring"})
        assert not (has_positive and example.label == "negative")
        assert not (has_negative and example.label == "positive")


def test_text_examples_are_deterministic_and_include_completions() -> None:
    examples = tiny_text_examples(30, seed=2)
    assert examples == tiny_text_examples(30, seed=2)
    assert examples != tiny_text_examples(30, seed=3)
    assert len(examples) == 30
    assert all(example.label is None for example in examples)
    completions = [example for example in examples if example.completion is not None]
    assert 0 < len(completions) < len(examples)


@pytest.mark.parametrize("helper", [tiny_sentiment_examples, tiny_text_examples])
def test_example_helpers_refuse_a_negative_count(helper) -> None:
    with pytest.raises(ValueError, match="count must be a non-negative integer"):
        helper(-1)


def test_free_port_never_hands_out_a_port_twice() -> None:
    from trainwire.testing import free_port

    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_free_port_never_hands_out_a_port_the_kernel_gives_for_port_0() -> None:
    from trainwire.testing import free_port

    first, last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not [port for port in (free_port() for _ in range(500)) if first <= port <= last]


def test_free_port_never_hands_out_a_port_another_process_holds() -> None:
    """Test processes side by side (pytest-xdist workers) each pick ports; drawn at random, 2,000
    here would meet some of the other process's 200 about 18 times, were they not reserved."""
    from trainwire.testing import free_port

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_PORTS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        held = set(json.loads(holder.stdout.readline()))
        assert len(held) == 200
        assert held.isdisjoint(free_port() for _ in range(2000))
    finally:
        holder.communicate(timeout=60)


HOLD_PORTS = """
import json, sys
from trainwire.testing import free_port
print(json.dumps([free_port() for _ in range(200)]), flush=True)
sys.stdin.read()  # holds the ports until the test is done
"""
