"""What one step of each tinker-cookbook recipe costs against trainwire: the recipe's own client
work and the server's, side by side.

    python bench/cookbook.py [--repeats N] [--recipes sl_loop,rl_loop,supervised,rl,dpo]

The recipes run as tests/test_cookbook_recipes.py runs them (tinker-cookbook from PyPI,
unchanged): a workspace with the tiny chat model and local data under the hub names the recipes
load, a ``trainwire serve --tinker-listen`` process per recipe run, and the recipe as its own
process from the workspace. A recipe writes one metrics.jsonl row per step; this script polls
that file and, at the first row and at the last, reads the wall clock and both processes' CPU
time (utime + stime of every thread, from /proc/<pid>/stat). The window between them is steady
state: the recipe's imports, the server's model load, the first step (its warm-up) and the final
save and close stay outside it and are shown apart, as "startup": the recipe's whole-run CPU
(``os.wait4``) less its window. Linux only (/proc).

The split says where a cookbook loop spends its time: client CPU per step is the recipe's own
Python (rendering, tokenizing, the SDK's HTTP and pydantic, its asyncio loop); server CPU per
step is everything the server process does for it (the HTTP front, the engine, torch's threads,
so it can pass 100% of wall on two cores); wall that neither covers is time neither process ran
(the SDK's poll intervals, round trips, other work on the machine holding the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the recipe test's server and arguments

from test_cookbook_recipes import RecipeServer, driver, recipe_env  # noqa: E402

from trainwire.cookbook_workspace import (  # noqa: E402
    make_workspace,
    write_no_robots,
    write_preference_file,
)

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
POLL_S = 0.005
RECIPE_TIMEOUT_S = 600


def sl_loop(url: str, log_path: Path) -> list[str]:
    """sl_loop as the recipe test runs it (batch 8), but at the recipe's own save_every (20):
    no step of a short run saves, so a step is a training step, not a checkpoint."""
    return [
        "-m", "tinker_cookbook.recipes.sl_loop", f"base_url={url}", f"log_path={log_path}",
        "batch_size=8",
    ]  # fmt: skip


def rl_loop(url: str, log_path: Path) -> list[str]:
    """rl_loop as the recipe test runs it (importance_sampling: the server does not implement
    the default stable_reinforce), 4 steps, at the recipe's own save_every (20)."""
    return [
        "-m", "tinker_cookbook.recipes.rl_loop", f"base_url={url}", f"log_path={log_path}",
        "batch_size=2", "group_size=4", "max_tokens=12", "max_steps=4",
        "loss_fn=importance_sampling",
    ]  # fmt: skip


def supervised(url: str, log_path: Path) -> list[str]:
    return driver("supervised", url, log_path)


def rl_plain(url: str, log_path: Path) -> list[str]:
    return driver("rl", url, log_path, "plain")


def dpo(url: str, log_path: Path) -> list[str]:
    return driver("dpo", url, log_path)


RECIPES: dict[str, Callable[[str, Path], list[str]]] = {
    "sl_loop": sl_loop,
    "rl_loop": rl_loop,
    "supervised": supervised,
    "rl": rl_plain,
    "dpo": dpo,
}


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, every thread, user + system, plus its reaped children
    (fields 14-17 of /proc/<pid>/stat; readable while the process is a zombie too)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return sum(int(field) for field in fields[11:15]) / TICKS_PER_S


@dataclass(frozen=True)
class Sample:
    """The wall clock and both processes' CPU seconds when ``rows`` metrics rows were seen."""

    rows: int
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float


@dataclass(frozen=True)
class Run:
    """One recipe run: its steady-state window (first row to last) and its whole-run totals."""

    first: Sample
    last: Sample
    total_wall_s: float
    total_client_cpu_s: float

    @property
    def steps(self) -> int:
        return self.last.rows - self.first.rows

    @property
    def wall_s(self) -> float:
        return self.last.wall_s - self.first.wall_s

    @property
    def client_cpu_s(self) -> float:
        return self.last.client_cpu_s - self.first.client_cpu_s

    @property
    def server_cpu_s(self) -> float:
        return self.last.server_cpu_s - self.first.server_cpu_s


def count_rows(path: Path) -> int:
    """Step rows in metrics.jsonl: complete lines with a timing field (every recipe times its
    steps; the RL entry point's closing row of cumulative token counts is no step)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    rows = [json.loads(line) for line in lines if line.endswith("\n") and line.strip()]
    return sum(1 for row in rows if any(key.startswith("time") for key in row))


def watch(process: subprocess.Popen[bytes], server_pid: int, metrics: Path) -> Run:
    """Poll metrics.jsonl until the recipe exits; sample at each new row. ``os.wait4`` reaps the
    recipe (so Popen never does) and gives its whole-run CPU, its reaped children included."""
    started = time.perf_counter()
    samples: list[Sample] = []
    rusage = None
    while rusage is None:
        if time.perf_counter() - started > RECIPE_TIMEOUT_S:
            process.kill()
        rows = count_rows(metrics)
        if rows and (not samples or rows > samples[-1].rows):
            # both CPU readings before the zombie is reaped: /proc/<pid> is gone after
            samples.append(Sample(rows, time.perf_counter(), cpu_s(process.pid), cpu_s(server_pid)))
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            rusage, process.returncode = usage, os.waitstatus_to_exitcode(status)
        else:
            time.sleep(POLL_S)
    rows = count_rows(metrics)  # a last row written just before exit, after the last poll
    if process.returncode != 0 or not samples or rows != samples[-1].rows:
        raise RuntimeError(f"recipe exited {process.returncode}, {rows} rows in {metrics}")
    if samples[-1].rows == samples[0].rows:
        raise RuntimeError(f"no step after the first in {metrics}: give the recipe more steps")
    total_wall_s = time.perf_counter() - started
    return Run(samples[0], samples[-1], total_wall_s, rusage.ru_utime + rusage.ru_stime)


def run_recipe(name: str, workspace: Path, tmp: Path) -> Run:
    """One run of a recipe on its own fresh server (the DPO recipe leaves its client open)."""
    tmp.mkdir(parents=True)
    server = RecipeServer(tmp, workspace, name)
    try:
        log_path = tmp / f"{name}-run"
        args = RECIPES[name](server.url, log_path)
        # A datasets cache of this run's own: offline, a shared one answers a hub name with
        # whatever copy it cached first, whatever the workspace now holds.
        env = {**recipe_env(), "HF_DATASETS_CACHE": str(workspace.parent / "datasets-cache")}
        with open(tmp / f"{name}.log", "ab") as out:
            process = subprocess.Popen(
                [sys.executable, *args], cwd=workspace, env=env, stdout=out, stderr=out
            )
        try:
            return watch(process, server.process.process.pid, log_path / "metrics.jsonl")
        except RuntimeError as error:
            tail = (tmp / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name}: {error}\n{tail}") from None
    finally:
        server.kill()


def summary_row(name: str, runs: list[Run]) -> str:
    """Window figures summed over the repeats, then divided by their steps: a weighted mean."""
    steps = sum(run.steps for run in runs)
    wall = sum(run.wall_s for run in runs) / steps
    client = sum(run.client_cpu_s for run in runs) / steps
    server = sum(run.server_cpu_s for run in runs) / steps
    startup_wall = sum(run.total_wall_s - run.wall_s for run in runs) / len(runs)
    startup_client = sum(run.total_client_cpu_s - run.client_cpu_s for run in runs) / len(runs)
    per_run = "/".join(f"{run.wall_s / run.steps * 1e3:.0f}" for run in runs)
    return (
        f"{name:<11}{steps:>6}{wall * 1e3:>10.0f}{client * 1e3:>10.0f}{server * 1e3:>10.0f}"
        f"{client / wall:>9.0%}{server / wall:>9.0%}{client / (client + server):>9.0%}"
        f"{startup_wall:>10.1f}{startup_client:>10.1f}   {per_run}"
    )


def header() -> str:
    return (
        f"{'recipe':<11}{'steps':>6}{'wall':>10}{'client':>10}{'server':>10}"
        f"{'client':>9}{'server':>9}{'client':>9}{'startup':>10}{'startup':>10}   wall ms/step\n"
        f"{'':<11}{'':>6}{'ms/step':>10}{'CPU ms':>10}{'CPU ms':>10}"
        f"{'% wall':>9}{'% wall':>9}{'% CPU':>9}{'wall s':>10}{'client s':>10}   per repeat"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each recipe (default 1)")
    parser.add_argument(
        "--recipes",
        default=",".join(RECIPES),
        help=f"comma-separated, from {', '.join(RECIPES)} (default: all)",
    )
    args = parser.parse_args()
    names = [name.strip() for name in args.recipes.split(",") if name.strip()]
    unknown = [name for name in names if name not in RECIPES]
    if unknown or not names or args.repeats < 1:
        parser.error(f"--recipes from {', '.join(RECIPES)}; --repeats >= 1 (got {unknown})")
    print(
        f"{os.cpu_count()} CPUs; steady state: first metrics row to last; "
        "startup: the rest of the run (averaged per run)"
    )
    with tempfile.TemporaryDirectory(prefix="trainwire-bench-") as tmp:
        work = Path(tmp)
        workspace = make_workspace(work / "workspace")
        # More rows than the recipe test's, so each window holds several steps: sl_loop 8
        # steps of 8, dpo 4. The supervised driver's chat file gives 5 (48 less 8 held out),
        # the RL driver's arithmetic environment is fixed at 3 batches.
        write_no_robots(workspace, count=64)
        write_preference_file(workspace, count=32)
        print(header(), flush=True)
        for name in names:
            runs = []
            for repeat in range(args.repeats):
                runs.append(run_recipe(name, workspace, work / f"{name}-{repeat}"))
            print(summary_row(name, runs), flush=True)


if __name__ == "__main__":
    main()
