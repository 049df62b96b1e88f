"""``python -m trainwire.cookbook_workspace DIR``, the README's one command before a cookbook
recipe runs offline: it writes the tiny chat model and the datasets under the hub names the
recipes load, the same bytes every time, and the recipes' own loaders find them there.
(tests/test_readme_walk.py runs the README's block itself: the recipe trains on it.)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainwire.cookbook_workspace import MODEL_NAME

pytestmark = pytest.mark.slow  # each test starts Python processes that import torch

# What sl_loop and rl_loop call first, from the directory they run in: the tokenizer and renderer
# of their default model, and their datasets by hub id (offline, so only a local folder serves).
RECIPE_LOADS = f"""
import datasets
from tinker_cookbook import model_info
from tinker_cookbook.tokenizer_utils import get_tokenizer

tokenizer = get_tokenizer({MODEL_NAME!r})
print("renderer", model_info.get_recommended_renderer_name({MODEL_NAME!r}))
print("chat", repr(tokenizer.apply_chat_template([{{"role": "user", "content": "Hi"}}],
                                                tokenize=False, add_generation_prompt=True)))
no_robots = datasets.load_dataset("HuggingFaceH4/no_robots")
print("no_robots", len(no_robots["train"]), no_robots["train"][0]["messages"][0]["role"])
gsm8k = datasets.load_dataset("openai/gsm8k", "main")
print("gsm8k", len(gsm8k["train"]), gsm8k["train"][0]["answer"].split("####")[-1].strip())
"""


def write_workspace(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwire.cookbook_workspace", str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def file_digests(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_one_command_writes_the_workspace_the_recipes_load_offline(tmp_path: Path) -> None:
    workspace = tmp_path / "cookbook"
    written = write_workspace(workspace)
    assert written.returncode == 0, written.stderr
    assert written.stdout == (
        f"wrote {workspace}: model {MODEL_NAME}, datasets HuggingFaceH4/no_robots and "
        "openai/gsm8k, chats.jsonl, preferences.jsonl\n"
    )
    loads = subprocess.run(
        [sys.executable, "-c", RECIPE_LOADS],
        cwd=workspace,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert loads.returncode == 0, loads.stderr[-3000:]
    assert loads.stdout.splitlines() == [
        "renderer role_colon",
        "chat '<s>User: Hi\\n\\nAssistant:'",
        "no_robots 32 user",
        "gsm8k 32 3",
    ]


def test_the_workspace_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    for name in ("first", "second"):
        assert write_workspace(tmp_path / name).returncode == 0
    first = file_digests(tmp_path / "first")
    assert f"{MODEL_NAME}/model.safetensors" in first
    assert first == file_digests(tmp_path / "second")


def test_a_file_in_the_way_is_refused_in_one_line(tmp_path: Path) -> None:
    in_the_way = tmp_path / "cookbook"
    in_the_way.write_text("notes\n")
    refused = write_workspace(in_the_way)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == (
        f"python -m trainwire.cookbook_workspace: error: {in_the_way} is a file, not a "
        "directory: name a directory to write the workspace into"
    )
    assert in_the_way.read_text() == "notes\n"
