"""The tinker-cookbook's recipes (0.6.1, from PyPI, unchanged) against real ``trainwire serve``
processes, offline: each recipe runs as its own process from a workspace holding the tiny chat
model and local data under the names the recipes load (``cookbook_workspace``).

Only the server's address and key, the model, the data and sizes a CPU finishes in seconds
differ from the recipes' own settings. One deliberate exception: the RL recipes train with
``importance_sampling`` rather than their default ``stable_reinforce``, whose objective this
server does not implement (it refuses it with the reason; see the README).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import wait_for
from test_tinker_restart import TinkerServeProcess, logged
from tinker_loops import KEY

from trainwire.cookbook_workspace import MODEL_NAME, make_workspace
from trainwire.testing import free_port

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent
RECIPE_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("cookbook"))


class RecipeServer:
    """``trainwire serve`` with the Tinker front on a fixed port, the workspace as its model
    root; ``restart`` SIGKILLs it and starts another on the same state directory and port."""

    def __init__(self, tmp: Path, workspace: Path, name: str) -> None:
        self.tmp, self.workspace, self.name = tmp, workspace, name
        self.state_dir, self.port, self.starts = tmp / f"{name}-state", free_port(), 0
        self.process = self._start()

    def _start(self) -> TinkerServeProcess:
        self.starts += 1
        name = f"{self.name}-{self.starts}"
        return TinkerServeProcess(self.tmp, self.state_dir, self.workspace, self.port, name)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        self.process.kill()
        self.process = self._start()

    def state_digest(self) -> str:
        return self.process.state_digest()

    def kill(self) -> None:
        self.process.kill()


def serve(tmp: Path, workspace: Path, name: str) -> RecipeServer:
    return RecipeServer(tmp, workspace, name)


def base_url(server: RecipeServer) -> str:
    return server.url


def recipe_env(workspace: Path) -> dict[str, str]:
    """The key, offline, and a datasets cache of the workspace's own (a shared cache may hold
    another workspace's rows under the same local name). The drivers import from tests/ and
    from the trainwire this suite imports (the caller's PYTHONPATH kept)."""
    import_path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        "TINKER_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(workspace / ".datasets-cache"),
        "PYTHONPATH": os.pathsep.join(import_path),
    }


def start_recipe(workspace: Path, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A recipe as a user runs it: its own process, from the workspace."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=workspace,
            env=recipe_env(workspace),
            stdout=out,
            stderr=out,
        )


def run_recipe(workspace: Path, args: list[str], log: Path) -> None:
    process = start_recipe(workspace, args, log)
    code = process.wait(timeout=RECIPE_TIMEOUT_S)
    assert code == 0, log.read_text(errors="replace")[-4000:]


def metrics(log_path: Path) -> list[dict[str, Any]]:
    lines = (log_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def sl_loop(url: str, log_path: Path) -> list[str]:
    """``python -m tinker_cookbook.recipes.sl_loop`` with a CPU-sized batch."""
    return [
        "-m", "tinker_cookbook.recipes.sl_loop", f"base_url={url}", f"log_path={log_path}",
        "batch_size=8", "save_every=2",
    ]  # fmt: skip


def driver(recipe: str, url: str, log_path: Path, *rest: str) -> list[str]:
    return [str(TESTS / "cookbook_drivers.py"), recipe, url, str(log_path), *rest]


def nll_by_step(log_path: Path) -> dict[int, float]:
    return {
        row["step"]: row["train_mean_nll"] for row in metrics(log_path) if "train_mean_nll" in row
    }


@pytest.fixture(scope="module")
def uninterrupted_sl_loop(
    tmp_path_factory: pytest.TempPathFactory, workspace: Path
) -> Iterator[tuple[dict[int, float], str]]:
    """sl_loop on its own server, never interrupted: its losses by step and final digest."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    server = serve(tmp_path, workspace, "plain")
    try:
        log_path = tmp_path / "plain-run"
        run_recipe(workspace, sl_loop(base_url(server), log_path), tmp_path / "plain.log")
        yield nll_by_step(log_path), server.state_digest()
    finally:
        server.kill()


def test_sl_loop_runs_unchanged_and_a_server_sigkilled_mid_run_changes_nothing(
    tmp_path: Path, workspace: Path, uninterrupted_sl_loop: tuple[dict[int, float], str]
) -> None:
    expected_nll, expected_digest = uninterrupted_sl_loop
    assert sorted(expected_nll) == [0, 1, 2, 3]
    server = serve(tmp_path, workspace, "killed")
    log_path = tmp_path / "killed-run"
    recipe = start_recipe(workspace, sl_loop(base_url(server), log_path), tmp_path / "k.log")
    try:
        # seq 1 is step 0's forward_backward, 2 its optim_step, 4 step 1's optim_step: kill
        # once that is accepted (its poll pending), before the recipe's first checkpoint.
        wait_for(logged(server.state_dir, "optim_step", 4), RECIPE_TIMEOUT_S)
        server.restart()
        assert recipe.wait(timeout=RECIPE_TIMEOUT_S) == 0, (tmp_path / "k.log").read_text()[-3000:]
        assert nll_by_step(log_path) == expected_nll  # exactly: the same bits
        assert server.state_digest() == expected_digest
    finally:
        recipe.kill()
        server.kill()


def test_sl_loop_killed_after_a_checkpoint_resumes_from_it_as_if_never_stopped(
    tmp_path: Path, workspace: Path, uninterrupted_sl_loop: tuple[dict[int, float], str]
) -> None:
    """The recipe's own resume: run again, it starts a new run from its last checkpoint with
    the optimizer state (create_training_client_from_state_with_optimizer), once the killed
    script's model has given way."""
    expected_nll, _ = uninterrupted_sl_loop
    server = serve(tmp_path, workspace, "resumed")
    log_path = tmp_path / "resumed-run"
    args = sl_loop(base_url(server), log_path)
    try:
        first = start_recipe(workspace, args, tmp_path / "first.log")
        checkpoints = log_path / "checkpoints.jsonl"
        wait_for(lambda: checkpoints.is_file() and checkpoints.read_text().strip(), 300)
        first.kill()  # SIGKILL: the script never closes its ServiceClient
        first.wait(timeout=60)
        assert json.loads(checkpoints.read_text().splitlines()[-1])["batch"] == 2
        run_recipe(workspace, args, tmp_path / "second.log")
        assert "Resuming from batch 2" in (tmp_path / "second.log").read_text()
        resumed = nll_by_step(log_path)
        assert {step: resumed[step] for step in (2, 3)} == {s: expected_nll[s] for s in (2, 3)}
    finally:
        server.kill()


def test_rl_loop_runs_unchanged(tmp_path: Path, workspace: Path) -> None:
    server = serve(tmp_path, workspace, "rl-loop")
    log_path = tmp_path / "rl-loop-run"
    args = [
        "-m", "tinker_cookbook.recipes.rl_loop", f"base_url={base_url(server)}",
        f"log_path={log_path}", "batch_size=2", "group_size=4", "max_tokens=12", "max_steps=2",
        "save_every=1", "loss_fn=importance_sampling",
    ]  # fmt: skip
    try:
        run_recipe(workspace, args, tmp_path / "rl-loop.log")
        rows = metrics(log_path)
        assert len(rows) == 2 and all("reward/total" in row for row in rows)
    finally:
        server.kill()


@pytest.fixture(scope="module")
def library_server(
    tmp_path_factory: pytest.TempPathFactory, workspace: Path
) -> Iterator[RecipeServer]:
    """One server for the library entry points (each closes its ServiceClient when done)."""
    tmp = tmp_path_factory.mktemp("library")
    server = serve(tmp, workspace, "library")
    yield server
    server.kill()


def test_supervised_entry_point_evaluates_checkpoints_asynchronously_and_resumes(
    tmp_path: Path, workspace: Path, library_server: RecipeServer
) -> None:
    """Killed after its first asynchronous checkpoint, the entry point run again resumes from
    it (a new run with the optimizer state) and finishes, evaluating as it goes."""
    url, log_path = base_url(library_server), tmp_path / "sft"
    first = start_recipe(workspace, driver("supervised", url, log_path), tmp_path / "first.log")
    checkpoints = log_path / "checkpoints.jsonl"
    wait_for(lambda: checkpoints.is_file() and checkpoints.read_text().strip(), 300)
    first.kill()
    first.wait(timeout=60)
    run_recipe(workspace, driver("supervised", url, log_path), tmp_path / "again.log")
    again = (tmp_path / "again.log").read_text(errors="replace")
    assert "Resumed training from" in again and "/weights/000002" in again
    assert any("test/nll" in row for row in metrics(log_path))  # its evaluator ran
    saved = [json.loads(line)["name"] for line in checkpoints.open()]
    assert saved[0] == "000002" and saved[-1] == "final"


@pytest.mark.parametrize("variant", ["kl", "async", "stream"])
def test_rl_entry_point_runs_with_a_kl_penalty_async_and_streaming(
    tmp_path: Path, workspace: Path, library_server: RecipeServer, variant: str
) -> None:
    log_path = tmp_path / f"rl-{variant}"
    args = driver("rl", base_url(library_server), log_path, variant)
    run_recipe(workspace, args, tmp_path / f"rl-{variant}.log")
    rows = metrics(log_path)
    assert rows and all("env/all/reward/total" in row for row in rows if "progress/batch" in row)
    if variant == "kl":
        assert any("kl_policy_base" in row for row in rows)


def test_dpo_recipe_runs_on_a_local_preference_file(tmp_path: Path, workspace: Path) -> None:
    server = serve(tmp_path, workspace, "dpo")  # its own: the recipe leaves its client open
    try:
        log_path = tmp_path / "dpo"
        run_recipe(workspace, driver("dpo", base_url(server), log_path), tmp_path / "dpo.log")
        losses = [row["dpo_loss"] for row in metrics(log_path) if "dpo_loss" in row]
        assert losses and losses[-1] < losses[0]
    finally:
        server.kill()


def test_a_weights_download_loads_with_peft(
    tmp_path: Path, workspace: Path, library_server: RecipeServer
) -> None:
    """``tinker_cookbook.weights.download`` of a recipe's final checkpoint: the archive this
    server signs and serves, decrypted by the cookbook, loads with PEFT on the base model."""
    log_path = tmp_path / "sft"
    run_recipe(
        workspace, driver("supervised", base_url(library_server), log_path), tmp_path / "s.log"
    )
    state_path = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])[
        "state_path"
    ]
    script = (
        "import sys; from tinker_cookbook import weights; "
        "weights.download(tinker_path=sys.argv[1], output_dir=sys.argv[2], base_url=sys.argv[3])"
    )
    out = tmp_path / "adapter"
    run_recipe(
        workspace,
        ["-c", script, state_path, str(out), base_url(library_server)],
        tmp_path / "d.log",
    )
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(workspace / MODEL_NAME)
    model = PeftModel.from_pretrained(base, out)
    assert model.peft_config["default"].r == 8
    logits = model(torch.tensor([[2, 56, 86]])).logits
    assert torch.isfinite(logits).all()
