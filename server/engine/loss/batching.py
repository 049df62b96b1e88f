"""Examples to tensors: tokenization, completion masking, length checks and padding.

Nothing is lost silently: an example longer than ``max_length`` tokens is refused with its
index unless the config asks for truncation, and every example of a batch is encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainwire.contract.config import InputExample, TrainingConfig
from trainwire.contract.planning.plan import check_examples
from trainwire.server.engine.loss.chunked_logprobs import LOGITS_CHUNK_BYTES
from trainwire.server.errors import InvalidArgument

IGNORE_INDEX = -100  # the label id Hugging Face losses skip
# No tokenizer this package loads has a token longer than this many characters, so a text longer
# than max_length * MAX_CHARS_PER_TOKEN is refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 64


@dataclass
class Batch:
    """Model inputs for one batch, on the session's device."""

    inputs: dict[str, torch.Tensor]
    example_count: int
    token_count: int  # non-padding tokens, for throughput figures
    # What one chunk of logits may take when a causal-lm loss is computed (``chunked_logprobs``):
    # the session's, fixed for a run.
    logits_chunk_bytes: int = LOGITS_CHUNK_BYTES


def check_max_length(config: TrainingConfig, model_positions: int | None) -> None:
    """InvalidArgument for a ``max_length`` past the model's positions (None: unknown).

    Every batch is bounded by ``max_length``, and a sequence longer than the model's positions
    is one it cannot read: such a config is refused when the session is built, with the limit,
    never quietly trained at a shorter length than the caller asked for."""
    if model_positions is not None and config.max_length > model_positions:
        raise InvalidArgument(
            f"max_length {config.max_length} is more than the {model_positions} positions of "
            f"model {config.model!r} (its max_position_embeddings): set max_length to at most "
            f"{model_positions}"
        )


class BatchEncoder:
    """Encodes examples for one session's task with its tokenizer."""

    def __init__(
        self,
        tokenizer,
        config: TrainingConfig,
        device: torch.device,
        *,
        model_positions: int | None = None,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise InvalidArgument(f"the tokenizer of {config.model} has no pad token")
        check_max_length(config, model_positions)
        self.tokenizer = tokenizer
        self.config = config
        self.max_length = config.max_length
        self.model_positions = model_positions  # where a too-long example is told its bound
        self.device = device
        self.label_ids = {label: i for i, label in enumerate(config.labels)}
        # Read once: each read goes through the tokenizer's special-token lookup.
        self.pad_id: int = tokenizer.pad_token_id
        self.eos: list[int] = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        # What one chunk of logits may take in the batches it encodes (the session's).
        self.logits_chunk_bytes = LOGITS_CHUNK_BYTES

    def encode(self, examples: Sequence[InputExample]) -> Batch:
        """Validate and encode a batch; raises ``InvalidArgument`` naming the bad example."""
        if not examples:
            raise InvalidArgument("empty batch: send at least one example")
        try:
            check_examples(examples, self.config)
        except ValueError as error:
            raise InvalidArgument(str(error)) from None
        self._refuse_texts_too_long_to_fit(examples)
        # One tokenizer call per batch, not per example: the same ids, a fraction of the time.
        texts = self.token_ids([e.text for e in examples], special=True)
        if self.config.task == "causal-lm":
            # check_examples refused empty completions: "" here stands for "no completion"
            # (a batch of none skips that tokenizer call).
            completions = [[] for _ in examples]
            if any(e.completion is not None for e in examples):
                completions = self.token_ids([e.completion or "" for e in examples], special=False)
            rows = [
                self._causal_lm_row(i, prompt, completion if e.completion is not None else None)
                for i, (e, prompt, completion) in enumerate(
                    zip(examples, texts, completions, strict=True)
                )
            ]
        else:
            rows = [
                (self._fit(i, ids), self.label_ids[e.label])
                for i, (e, ids) in enumerate(zip(examples, texts, strict=True))
            ]
        return self._pad(rows)

    def _refuse_texts_too_long_to_fit(self, examples: Sequence[InputExample]) -> None:
        """Before tokenizing: a text of more than ``MAX_CHARS_PER_TOKEN`` characters a token
        cannot fit, and tokenizing megabytes would hold the engine thread for seconds first."""
        if self.config.truncation:
            return  # it will be cut; the request's total size is bounded before it is queued
        limit = self.max_length * MAX_CHARS_PER_TOKEN
        for index, example in enumerate(examples):
            chars = len(example.text) + len(example.completion or "")
            if chars > limit:
                raise InvalidArgument(
                    f"example {index}: {chars} characters cannot fit max_length "
                    f"{self.max_length} tokens; shorten it or set truncation true"
                )

    def token_ids(self, texts: list[str], *, special: bool) -> list[list[int]]:
        """One tokenizer call for all ``texts`` (special tokens added when ``special``)."""
        return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def _fit(self, index: int, ids: list[int]) -> list[int]:
        limit = self.max_length
        if len(ids) <= limit:
            return ids
        if not self.config.truncation:
            raise InvalidArgument(
                f"example {index}: {len(ids)} tokens is over max_length {limit}; shorten it, "
                "raise max_length, or set truncation true to cut it"
            )
        return ids[:limit]

    def _causal_lm_row(
        self, index: int, prompt: list[int], completion: list[int] | None
    ) -> tuple[list[int], list[int]]:
        eos = self.eos
        if completion is None:
            ids = self._fit(index, prompt + eos)
            if len(ids) < 2:  # its one token predicts nothing: a loss over no token
                raise InvalidArgument(
                    f"example {index}: {len(ids)} token leaves nothing to learn; a causal-lm "
                    f"text needs at least 2 tokens (max_length is {self.max_length})"
                )
            return ids, list(ids)
        ids = self._fit(index, prompt + completion + eos)
        labels = ([IGNORE_INDEX] * len(prompt) + completion + eos)[: len(ids)]
        if all(label == IGNORE_INDEX for label in labels):
            raise InvalidArgument(
                f"example {index}: truncation to max_length {self.max_length} leaves no "
                "completion token to learn"
            )
        return ids, labels

    def _pad(self, rows: list[tuple[list[int], list[int] | int]]) -> Batch:
        width = max(len(ids) for ids, _ in rows)
        # Padded as lists, then one tensor per field: a tensor per row and field costs tens of
        # microseconds each, which a tiny model's step notices.
        input_ids = torch.tensor([ids + [self.pad_id] * (width - len(ids)) for ids, _ in rows])
        attention_mask = torch.tensor(
            [[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]
        )
        if self.config.task == "causal-lm":
            labels = torch.tensor(
                [labels + [IGNORE_INDEX] * (width - len(labels)) for _, labels in rows]
            )
        else:
            labels = torch.tensor([label for _, label in rows], dtype=torch.long)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        return Batch(
            inputs={name: tensor.to(self.device) for name, tensor in inputs.items()},
            example_count=len(rows),
            token_count=sum(len(ids) for ids, _ in rows),
            logits_chunk_bytes=self.logits_chunk_bytes,
        )
