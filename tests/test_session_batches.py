"""What a TrainingSession makes of a batch: completion labels mask the prompt and the padding, the
loss counts completion tokens only, long examples are refused unless truncation is asked for,
forward predicts labels, and a bad batch is refused with nothing changed.
"""

from __future__ import annotations

import pytest
import torch
from fresh_state import fresh_digest

from trainwire.client import InputExample
from trainwire.server.engine.loss.batching import IGNORE_INDEX
from trainwire.server.engine.session import TrainingSession
from trainwire.server.errors import InvalidArgument
from trainwire.testing import SENTIMENT_LABELS, tiny_sentiment_examples

PROMPT = "Question: what is 1 plus 2? Answer:"


def test_completion_labels_mask_the_prompt_and_padding(llama_config) -> None:
    session = TrainingSession(llama_config())
    tokenizer = session.tokenizer
    examples = [InputExample(PROMPT, completion=" 3."), InputExample("Hi there.")]
    inputs = session.encoder.encode(examples).inputs

    prompt = tokenizer(PROMPT)["input_ids"]
    completion = tokenizer(" 3.", add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id]
    row = prompt + completion + eos
    assert inputs["input_ids"][0].tolist() == row
    assert inputs["labels"][0].tolist() == [IGNORE_INDEX] * len(prompt) + completion + eos
    plain = tokenizer("Hi there.")["input_ids"] + eos
    padding = len(row) - len(plain)
    assert inputs["labels"][1].tolist() == plain + [IGNORE_INDEX] * padding
    assert inputs["attention_mask"][1].tolist() == [1] * len(plain) + [0] * padding
    assert inputs["input_ids"][1].tolist()[len(plain) :] == [tokenizer.pad_token_id] * padding


def test_prompt_tokens_never_become_labels(llama_config) -> None:
    session = TrainingSession(llama_config())
    other_prompt = PROMPT.replace("1 plus 2", "3 plus 4")
    a = session.encoder.encode([InputExample(PROMPT, completion=" 3.")]).inputs
    b = session.encoder.encode([InputExample(other_prompt, completion=" 3.")]).inputs
    assert not torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["labels"], b["labels"])


def test_the_loss_counts_completion_tokens_only(llama_config) -> None:
    session = TrainingSession(llama_config())
    example = InputExample(PROMPT, completion=" 3.")
    inputs = session.encoder.encode([example]).inputs
    with torch.no_grad():
        logits = session.model(input_ids=inputs["input_ids"]).logits.float()[0, :-1]
    targets = inputs["input_ids"][0, 1:]
    completion = inputs["labels"][0, 1:] != IGNORE_INDEX
    assert completion.sum() == 3  # " 3." is two tokens, then the end of sequence
    cross_entropy = torch.nn.functional.cross_entropy
    completion_only = cross_entropy(logits[completion], targets[completion]).item()
    every_token = cross_entropy(logits, targets).item()

    loss = session.forward([example]).loss
    # The session sums the logprobs in chunks (``chunked_logprobs``), cross_entropy over the
    # whole logits: the same mean of 3 terms of magnitude ~6, a few ulps apart at most.
    assert loss == pytest.approx(completion_only, rel=1e-6, abs=0)
    assert loss != pytest.approx(every_token, rel=1e-3)
    assert session.forward([InputExample(PROMPT + " 3.")]).loss != loss


def test_truncation_cuts_long_examples_only_when_asked(llama_config) -> None:
    long_text = "The movie was good, and the food was great. " * 20
    refused = TrainingSession(llama_config(max_length=16))
    digest = fresh_digest(refused)
    batch = [InputExample("Hi."), InputExample(long_text)]
    with pytest.raises(InvalidArgument, match=r"example 1: \d+ tokens is over max_length 16"):
        refused.forward_backward(batch)
    with pytest.raises(InvalidArgument, match=r"example 1: \d+ tokens is over max_length 16"):
        refused.forward(batch)
    assert fresh_digest(refused) == digest

    truncating = TrainingSession(llama_config(max_length=16, truncation=True))
    batch = truncating.encoder.encode([InputExample(long_text)])
    assert batch.inputs["input_ids"].shape == (1, 16)
    truncating.forward_backward([InputExample(long_text)])
    with pytest.raises(InvalidArgument, match="leaves no completion token to learn"):
        truncating.forward_backward([InputExample(long_text, completion=" yes")])


def test_a_text_cut_to_one_token_is_refused_for_it_predicts_nothing(llama_config) -> None:
    """A causal-lm loss is a mean over the tokens a text predicts: one token predicts none."""
    session = TrainingSession(llama_config(max_length=1, truncation=True))
    digest = fresh_digest(session)
    with pytest.raises(InvalidArgument, match="example 0: 1 token leaves nothing to learn"):
        session.forward_backward([InputExample("Hi.")])
    assert fresh_digest(session) == digest


def test_forward_predicts_labels_and_changes_nothing(bert_classifier_config) -> None:
    session = TrainingSession(bert_classifier_config(), max_steps=1)
    examples = tiny_sentiment_examples(4)
    session.forward_backward(examples)
    digest = fresh_digest(session)
    result = session.forward(examples)
    assert fresh_digest(session) == digest
    assert len(result.predictions) == len(examples)
    for prediction in result.predictions:
        assert prediction.label in SENTIMENT_LABELS and len(prediction.scores) == 2
        top = max(range(2), key=prediction.scores.__getitem__)
        assert prediction.label == SENTIMENT_LABELS[top]
    assert session.forward(examples) == result


@pytest.mark.parametrize(
    ("examples", "message"),
    [
        ([], "empty batch: send at least one example"),
        (
            [InputExample("Fine.", label="positive"), InputExample("Meh.", label="meh")],
            r"example 1: unknown label 'meh'; the config's labels are \['negative', 'positive'\]",
        ),
        ([InputExample("No label.")], r"example 0: missing label"),
        ([InputExample("")], "example 0: empty text"),
    ],
)
def test_bad_batches_are_refused_and_change_nothing(
    bert_classifier_config, examples, message
) -> None:
    session = TrainingSession(bert_classifier_config())
    session.forward_backward(tiny_sentiment_examples(3))
    digest = fresh_digest(session)
    for operation in (session.forward, session.forward_backward):
        with pytest.raises(InvalidArgument, match=message):
            operation(examples)
    assert fresh_digest(session) == digest
