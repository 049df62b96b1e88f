"""Tiny deterministic datasets for the tiny models: sentiment reviews, causal-lm texts, tokens.

Each helper is seeded with its own :class:`random.Random` (the global streams are untouched) and
never imports torch, so client-side code and planning tests can use them too.
"""

from __future__ import annotations

import random
from typing import Any

from trainwire.contract.config import InputExample, is_int
from trainwire.contract.tokens import TokenExample

SENTIMENT_LABELS = ("negative", "positive")
"""The labels of :func:`tiny_sentiment_examples`, in the order a config should list them."""

# fmt: off
_POSITIVE_WORDS = (
    "good", "great", "excellent", "wonderful", "lovely", "happy",
    "brilliant", "amazing", "fantastic", "perfect", "delightful", "superb",
)
_NEGATIVE_WORDS = (
    "bad", "awful", "terrible", "sad", "poor", "boring",
    "horrible", "dreadful", "dull", "miserable", "weak", "disappointing",
)
# fmt: on
_SUBJECTS = ("movie", "film", "food", "service", "story", "music", "meal", "hotel", "show", "staff")
_SENTIMENT_TEMPLATES = (
    "The {subject} was {word}.",
    "I thought the {subject} was {word}.",
    "What a {word} {subject}!",
    "Honestly, the {subject} is {word}.",
    "The {subject} was {word} and the {other} was {word2}.",
    "A {word} {subject}, and a {word2} {other}.",
)


def tiny_sentiment_examples(count: int = 64, seed: int = 0) -> list[InputExample]:
    """Short reviews labelled ``positive`` or ``negative``, balanced and deterministic in ``seed``.

    The label follows from the sentiment words alone (every sentiment word in one text agrees),
    so a tiny classifier visibly learns the task within a few epochs.
    """
    _check_count(count)
    rng = random.Random(seed)
    polarities = [index % 2 == 1 for index in range(count)]
    rng.shuffle(polarities)
    examples = []
    for positive in polarities:
        words = _POSITIVE_WORDS if positive else _NEGATIVE_WORDS
        subject, other = rng.sample(_SUBJECTS, 2)
        word, word2 = rng.sample(words, 2)
        text = rng.choice(_SENTIMENT_TEMPLATES).format(
            subject=subject, other=other, word=word, word2=word2
        )
        examples.append(InputExample(text=text, label=SENTIMENT_LABELS[positive]))
    return examples


_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def tiny_text_examples(count: int, seed: int = 0) -> list[InputExample]:
    """Causal-lm examples, deterministic in ``seed``; every third one has a ``completion``.

    Plain texts (short sentences, counting) exercise the whole-text loss; prompts asking for a
    small sum, with the answer as ``completion``, exercise the completion-only loss.
    """
    _check_count(count)
    rng = random.Random(seed)
    examples = []
    for index in range(count):
        if index % 3 == 2:
            left, right = rng.randrange(5), rng.randrange(5)
            prompt = f"Question: what is {left} plus {right}? Answer:"
            examples.append(InputExample(text=prompt, completion=f" {left + right}."))
        elif index % 3 == 1:
            start = rng.randrange(10)
            run = ", ".join(str(number) for number in range(start, start + rng.randrange(3, 7)))
            examples.append(InputExample(text=f"Count with me: {run}."))
        else:
            subject = rng.choice(_SUBJECTS)
            word = rng.choice(_POSITIVE_WORDS + _NEGATIVE_WORDS)
            number = rng.choice(_NUMBER_WORDS)
            text = f"The {subject} was {word}, and {number} friends said so too."
            examples.append(InputExample(text=text))
    return examples


def _check_count(count: Any) -> None:
    if not is_int(count) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")


def tiny_token_examples(
    count: int = 3,
    *,
    seed: int = 0,
    vocab_size: int = 500,
    min_length: int = 4,
    max_length: int = 12,
) -> list[TokenExample]:
    """``count`` token examples of unequal lengths, with every per-token input set: weights
    (some negative), sampling logprobs q (about the tiny models' own, -4 to -8) and advantages.

    Ids start at 4, above the tiny tokenizers' special tokens, so no example holds an EOS.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(min_length, max_length)
        ids = [rng.randrange(4, vocab_size) for _ in range(n + 1)]
        out.append(
            TokenExample(
                ids[:-1],
                ids[1:],
                weights=[rng.uniform(-0.5, 1.5) for _ in range(n)],
                logprobs=[-rng.uniform(4.0, 8.0) for _ in range(n)],
                advantages=[rng.gauss(0, 1) for _ in range(n)],
            )
        )
    return out
