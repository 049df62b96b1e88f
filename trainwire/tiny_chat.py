"""A tiny chat model for the tinker-cookbook's recipes, offline: the tiny llama with a chat
template, room for a prompt plus its sample, saved under the hub names the recipes load.

The cookbook picks a renderer by model name; for the models its recipes default to (Qwen3.5 and
Llama 3 base models) that is ``role_colon``, which writes ``User: ...`` / ``Assistant: ...`` turns
after the tokenizer's BOS token and stops sampling on the string ``"\\n\\nUser:"``. The tiny
tokenizer already has BOS and EOS and spells any text; this adds the chat template (the same turns,
for ``apply_chat_template``) and more positions. The weights are the tiny llama's, unchanged.

A recipe loads its tokenizer with ``AutoTokenizer.from_pretrained("<org>/<name>")`` and its data
with ``datasets.load_dataset("<org>/<name>")``; both read a local directory of that relative path
first, so a directory holding ``<org>/<name>/`` serves a recipe run from it, with no download and no
option changed but the server's address, key, model root and data.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainwire.tiny_models import CONFIG_FILE, make_tiny_model

CHAT_POSITIONS = 1024  # a recipe's prompt (a few turns) plus its sample
# The role_colon renderer's turns, for apply_chat_template: the BOS, then "Role: content\n\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def make_tiny_chat_model(directory: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny chat model into ``directory`` (created if needed) and return it.

    The same arguments give the same bytes; the caller's global RNGs are untouched.
    """
    out = make_tiny_model(directory, seed=seed)
    config = json.loads((out / CONFIG_FILE).read_text(encoding="utf-8"))
    config["max_position_embeddings"] = CHAT_POSITIONS  # rotary positions: no new weights
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer = json.loads((out / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    tokenizer["chat_template"] = CHAT_TEMPLATE
    tokenizer["model_max_length"] = CHAT_POSITIONS
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer, indent=2, sort_keys=True) + "\n")
    return out
