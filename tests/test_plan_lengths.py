"""``trainwire plan`` counts every example's tokens as the session will (when the model's
tokenizer is on the planning machine) and refuses one over ``max_length`` naming its file and
line, before a run starts rather than microbatches into it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainwire.cli import main
from trainwire.client import InputExample, TrainingConfig
from trainwire.contract.planning.token_lengths import TokenCounter
from trainwire.server.engine.session import TrainingSession
from trainwire.testing import tiny_sentiment_examples, tiny_text_examples

ODD_TEXTS = ["héllo wörld ✓ 😀", "  leading and trailing  ", "tabs\tand\nnewlines", "a"]


def session_token_count(session: TrainingSession, example: InputExample) -> int:
    return session.encoder.encode([example]).token_count


def test_the_plans_count_is_the_session_encoders_for_a_decoder(tiny_llama):
    config = TrainingConfig(model=str(tiny_llama))
    session = TrainingSession(config, device="cpu")
    counter = TokenCounter.from_model_directory(tiny_llama, config.task)
    assert counter is not None
    examples = [*tiny_text_examples(30), *(InputExample(text) for text in ODD_TEXTS[:-1])]
    examples.append(InputExample("2 + 2 =", completion=" 4 ✓"))
    for example in examples:
        assert counter.count(example) == session_token_count(session, example), example


def test_the_plans_count_is_the_session_encoders_for_an_encoder(bert_classifier_config):
    config = bert_classifier_config()
    session = TrainingSession(config, device="cpu")
    counter = TokenCounter.from_model_directory(Path(config.model), config.task)
    assert counter is not None
    examples = tiny_sentiment_examples(30)
    examples += [InputExample(text, label=config.labels[0]) for text in ODD_TEXTS]
    for example in examples:
        assert counter.count(example) == session_token_count(session, example), example


def write_lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


@pytest.fixture
def planning(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model": tiny_llama.name, "max_length": 32}))
    return tmp_path


def test_plan_refuses_an_example_over_max_length_naming_its_file_and_line(
    planning, model_root, capsys
):
    write_lines(planning / "train.jsonl", [{"text": "short"}, {"text": "a long one " * 40}])
    base = ["plan", "--examples", "train.jsonl", "--config", "config.json", "--output", "m.json"]
    assert main([*base, "--model-root", str(model_root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainwire plan: error: train.jsonl:2: ")
    assert "tokens is over max_length 32" in err and "\n" not in err
    assert not (planning / "m.json").exists()
    # truncation on: the same file plans, and the session will cut the example
    assert main([*base, "--model-root", str(model_root), "--set", "truncation=true"]) == 0


def test_plan_without_the_model_at_hand_says_the_lengths_were_not_checked(planning, capsys):
    write_lines(planning / "train.jsonl", [{"text": "short"}])
    base = ["plan", "--examples", "train.jsonl", "--config", "config.json", "--output", "m.json"]
    assert main(base) == 0
    err = capsys.readouterr().err
    assert "example lengths not checked against max_length 32" in err
    assert "give --model-root DIR" in err


def test_a_bad_label_names_its_file_and_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = {"model": "m", "task": "sequence-classification", "labels": ["neg", "pos"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_lines(tmp_path / "train.jsonl", [{"text": "fine", "label": "pos"}])
    with open(tmp_path / "train.jsonl", "a", encoding="utf-8") as lines:
        lines.write("\n" + json.dumps({"text": "odd", "label": "meh"}) + "\n")
    args = ["plan", "--examples", "train.jsonl", "--config", "config.json", "--output", "m.json"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "trainwire plan: error: train.jsonl:3: unknown label 'meh'; "
        "the config's labels are ['neg', 'pos']"
    )
