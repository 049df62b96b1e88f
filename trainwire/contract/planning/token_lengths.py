"""How many tokens an example takes, counted at plan time without torch.

The session refuses an example longer than ``max_length`` when its microbatch runs, which can be
hours into a run. ``trainwire plan`` counts every example first, when the model's tokenizer is on
the planning machine: the ``tokenizers`` library reads the model's ``tokenizer.json`` (the same
fast tokenizer ``transformers`` wraps, with its special-token template), so the count is the
session encoder's (``BatchEncoder``): the text with special tokens, then for causal-lm the
completion without them and one end-of-sequence token. A test holds the two counts equal on
every tiny architecture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwire.contract.config import InputExample


class TokenCounter:
    """Counts examples' tokens with one model's tokenizer, as the session encodes them."""

    def __init__(self, tokenizer: Any, eos_id: int | None, task: str) -> None:
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        self.task = task

    @classmethod
    def from_model_directory(cls, directory: Path, task: str) -> TokenCounter | None:
        """The counter of the model in ``directory``; None without a ``tokenizer.json`` there
        (a slow-only tokenizer needs ``transformers``, and planning does not import it)."""
        from tokenizers import Tokenizer

        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        return cls(tokenizer, _eos_id(directory, tokenizer), task)

    def count(self, example: InputExample) -> int:
        ids = self.tokenizer.encode(example.text, add_special_tokens=True).ids
        if self.task != "causal-lm":
            return len(ids)
        completion = (
            []
            if example.completion is None
            else self.tokenizer.encode(example.completion, add_special_tokens=False).ids
        )
        return len(ids) + len(completion) + (self.eos_id is not None)


def _eos_id(directory: Path, tokenizer: Any) -> int | None:
    """The end-of-sequence token's id, from the tokenizer's config as ``transformers`` reads it."""
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    eos = json.loads(config_file.read_text(encoding="utf-8")).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return None if not isinstance(eos, str) else tokenizer.token_to_id(eos)
