"""A directory the tinker-cookbook's recipes run in, offline: the tiny chat model and small
datasets under the hub names the recipes load (``AutoTokenizer.from_pretrained`` and
``datasets.load_dataset`` read a local directory of that relative path first), plus a local chat
file and a preference file for the entry points that take a file.

The same directory is the server's ``--model-root``, so the recipe's ``model_name`` is the
``base_model`` the server opens. Everything is deterministic: the same bytes every run.

    python -m trainwire.cookbook_workspace DIR

writes it into DIR, so a recipe can be tried against a local server in minutes, with no hub
download (README.md, "The tinker-cookbook's recipes"); the recipe tests build theirs the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainwire.tiny_chat import make_tiny_chat_model

# The recipes' default model (sl_loop, rl_loop, sl_basic, rl_basic): renderer role_colon.
MODEL_NAME = "Qwen/Qwen3.5-9B-Base"
CHAT_FILE = "chats.jsonl"
PREFERENCE_FILE = "preferences.jsonl"

TOPICS = ["the cat", "a dog", "the birds", "my friend", "the river", "a small boat", "the sun"]
PLACES = ["on the mat", "in the park", "by the sea", "at home", "under the tree"]


def chats(count: int) -> list[list[dict[str, str]]]:
    """Short two-turn conversations, the same every time."""
    conversations = []
    for index in range(count):
        topic, place = TOPICS[index % len(TOPICS)], PLACES[index % len(PLACES)]
        conversations.append(
            [
                {"role": "user", "content": f"Where is {topic}?"},
                {"role": "assistant", "content": f"{topic.capitalize()} is {place}."},
            ]
        )
    return conversations


def _dataset_card(path: Path, configs: dict[str, dict[str, str]]) -> None:
    """A README whose YAML names each config's split files (what load_dataset reads)."""
    lines = ["---", "configs:"]
    for config, splits in configs.items():
        lines += [f"- config_name: {config}", "  data_files:"]
        for split, pattern in splits.items():
            lines += [f"  - split: {split}", f"    path: {pattern}"]
    path.write_text("\n".join([*lines, "---", ""]))


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def write_no_robots(root: Path, count: int = 32) -> None:
    """``HuggingFaceH4/no_robots``: ``messages`` per row (sl_loop and NoRobotsBuilder)."""
    directory = root / "HuggingFaceH4" / "no_robots"
    rows = [{"messages": chat, "category": "Chat"} for chat in chats(count)]
    _jsonl(directory / "data" / "train.jsonl", rows)
    _jsonl(directory / "data" / "test.jsonl", rows[:8])
    splits = {"train": "data/train.jsonl", "test": "data/test.jsonl"}
    _dataset_card(directory / "README.md", {"default": splits})


def write_gsm8k(root: Path, count: int = 32) -> None:
    """``openai/gsm8k`` (config ``main``): small sums written as GSM8K answers."""
    directory = root / "openai" / "gsm8k"
    rows = []
    for index in range(count):
        a, b = index % 7 + 1, index % 5 + 2
        rows.append(
            {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        )
    _jsonl(directory / "main" / "train.jsonl", rows)
    _jsonl(directory / "main" / "test.jsonl", rows[:8])
    _dataset_card(
        directory / "README.md", {"main": {"train": "main/train.jsonl", "test": "main/test.jsonl"}}
    )


def write_chat_file(root: Path, count: int = 48) -> Path:
    """A local chat dataset for ``FromConversationFileBuilder``: ``{"messages": [...]}`` lines."""
    path = root / CHAT_FILE
    _jsonl(path, [{"messages": chat} for chat in chats(count)])
    return path


def write_preference_file(root: Path, count: int = 24) -> Path:
    """A local preference set: a prompt, the chosen and the rejected answer."""
    rows = []
    for index, chat in enumerate(chats(count)):
        question, answer = chat[0]["content"], chat[1]["content"]
        wrong = f"{TOPICS[(index + 3) % len(TOPICS)].capitalize()} is nowhere."
        rows.append(
            {
                "comparison": {
                    "prompt_conversation": [{"role": "user", "content": question}],
                    "completion_A": [{"role": "assistant", "content": answer}],
                    "completion_B": [{"role": "assistant", "content": wrong}],
                },
                "label": "A",
            }
        )
    path = root / PREFERENCE_FILE
    _jsonl(path, rows)
    return path


def make_workspace(root: Path) -> Path:
    """The whole directory: model, datasets and files; returns ``root``."""
    make_tiny_chat_model(root / MODEL_NAME)
    write_no_robots(root)
    write_gsm8k(root)
    write_chat_file(root)
    write_preference_file(root)
    return root


def main(argv: list[str] | None = None) -> int:
    """``python -m trainwire.cookbook_workspace DIR``: write the workspace, say what is in it."""
    parser = argparse.ArgumentParser(
        prog="python -m trainwire.cookbook_workspace",
        description="Write a directory the tinker-cookbook's recipes run in offline: the tiny "
        f"chat model as {MODEL_NAME}, HuggingFaceH4/no_robots and openai/gsm8k as small local "
        "datasets, a chat file and a preference file. Serve it as --model-root and run a recipe "
        "from it.",
    )
    parser.add_argument("directory", type=Path, help="where to write it (created if needed)")
    directory = parser.parse_args(argv).directory
    if directory.exists() and not directory.is_dir():
        parser.error(
            f"{directory} is a file, not a directory: name a directory to write the workspace into"
        )
    root = make_workspace(directory)
    sys.stdout.write(
        f"wrote {root}: model {MODEL_NAME}, datasets HuggingFaceH4/no_robots and openai/gsm8k, "
        f"{CHAT_FILE}, {PREFERENCE_FILE}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
