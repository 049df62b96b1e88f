"""Walk the README as a new user does: every command and snippet, in order, on a fresh checkout.

The checkout is the repository's tracked files copied to a temporary directory (nothing built,
no models, no state), with ``.venv`` linked to the running one: nothing is installed, and
``make`` is told its venv stamp is current (``make -o .venv/.installed``) so it never reinstalls.
Each fenced block runs as written (each Python snippet twice, as a user runs it again), in the
checkout, with the venv's ``bin`` first on PATH; the only changes are the ports (free ones
instead of the README's fixed ones, which another process may hold), ``kill %1`` (no job control:
the background server gets SIGTERM) and what must not run here: ``pip install`` (the venv has it
all) and ``make test``/``make test-all`` (dry runs: the suite runs the suite). The cookbook
block runs too: it writes its own workspace of hub-named folders and trains a real recipe.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainwire.testing import free_port, wait_for_listener

REPO = Path(__file__).resolve().parents[1]
COMMAND_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60  # a server stops within seconds of SIGTERM; this is only its bound
# The README's fixed ports: its servers' gRPC and Tinker ports, and the cookbook server's.
README_PORTS = ("50051", "8000", "50052", "8001")


def fenced_blocks(readme: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", readme, flags=re.MULTILINE | re.DOTALL)


def shell_lines(body: str) -> list[str]:
    """The block's commands: continuation lines joined; comments and blank lines dropped."""
    joined = body.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip()]


class Walk:
    """The checkout, its environment, and the background processes the README starts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports = {port: str(free_port()) for port in README_PORTS}
        self.env = dict(os.environ, PATH=f"{root / '.venv' / 'bin'}:{os.environ['PATH']}")
        self.env.pop("PYTHONPATH", None)
        # A new user's shell, not a recipe of the make that may run this suite (`make test-all`):
        # a nested make would print its "Entering directory" lines around every command.
        for name in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"):
            self.env.pop(name, None)
        self.background: list[subprocess.Popen] = []
        self.transcript: list[str] = []

    def localized(self, text: str) -> str:
        for port, free in self.ports.items():
            text = text.replace(f"127.0.0.1:{port}", f"127.0.0.1:{free}")
        return text

    def shell(self, line: str) -> str:
        line = re.sub(r"\s+#.*$", "", self.localized(line))
        self.transcript.append(f"$ {line}")
        if line.startswith("pip install"):
            return ""
        if line == "kill %1":
            self.stop_background()
            return ""
        if re.match(r"make (test|test-all)\b", line):
            line = line.replace("make ", "make -n ", 1)
        if line.startswith("make "):
            line = line.replace("make ", "make -o .venv/.installed ", 1)
        if line.endswith("&"):
            return self.start_background(line[:-1].strip())
        done = subprocess.run(
            ["bash", "-c", line],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        self.transcript.append(done.stdout + done.stderr)
        assert done.returncode == 0, "\n".join(self.transcript[-6:])
        return done.stdout

    def python(self, body: str) -> str:
        script = self.root / "snippet.py"
        script.write_text(self.localized(body))
        return self.shell(f"python {script.name}")

    def start_background(self, line: str) -> str:
        log = open(self.root / f"background-{len(self.background)}.log", "wb")  # noqa: SIM115
        process = subprocess.Popen(
            ["bash", "-c", f"exec {line}"], cwd=self.root, env=self.env, stdout=log, stderr=log
        )
        self.background.append(process)
        for address in re.findall(r"-listen (\S+)", line):
            try:
                wait_for_listener(address, timeout_s=120)
            except TimeoutError:
                log.flush()
                log_text = Path(log.name).read_text(errors="replace")[-3000:]
                raise AssertionError(f"{line}\n{log_text}") from None
        return ""

    def stop_background(self) -> None:
        """SIGTERM each background command and wait for it; one still running after
        ``STOP_TIMEOUT_S`` is asked for its threads' stacks (a server writes them on SIGUSR1),
        killed, and fails the walk with the end of its log, where it waited."""
        background, self.background = self.background, []
        for process in background:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for index, process in enumerate(background):
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGUSR1)
                time.sleep(2)
                process.kill()
                process.wait(10)
                log = (self.root / f"background-{index}.log").read_text(errors="replace")
                raise AssertionError(
                    f"{process.args[-1]} did not stop within {STOP_TIMEOUT_S} s of SIGTERM; "
                    f"its log ends:\n{log[-12000:]}"
                ) from None


def fresh_checkout(tmp_path: Path) -> Path:
    """The tracked files of this repository, as a clone has them, with the venv linked."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git repository this test walks")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    root = tmp_path / "checkout"
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file() or source.is_symlink():  # the package's links stay links
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name, follow_symlinks=False)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the cookbook block adds a recipe run: about two minutes on two cores
def test_every_readme_command_and_snippet_runs_as_written_on_a_fresh_checkout(tmp_path):
    root = fresh_checkout(tmp_path)
    walk = Walk(root)
    outputs: list[str] = []
    try:
        for language, body in fenced_blocks((root / "README.md").read_text()):
            if language == "python":  # twice: a snippet runs again as written
                outputs.extend(walk.python(body) for _ in range(2))
            else:
                outputs.extend(walk.shell(line) for line in shell_lines(body))
        assert walk.shell("make help").startswith("make demo")
    finally:
        walk.stop_background()
        print("\n".join(walk.transcript))  # what a new user sees, for the failure's report
    text = "\n".join(outputs)
    # What a new user reads at each step: the demo's summary, the plan, the run, the loops.
    assert "final state digest      sha256:" in text  # make demo
    assert "wrote manifest.json: 48 examples" in text  # plan, on the shipped examples/
    assert "run my-run done at step" in text
    assert re.search(r"runs/local: \d+ updates, best \d+\.\d{1,4} at update \d+", text)
    assert '{"status":"ok"}' in text  # the Tinker front's health, before the SDK loop
    # the cookbook's sl_loop, unchanged, on the workspace the package writes: its final checkpoint
    assert "wrote cookbook: model Qwen/Qwen3.5-9B-Base" in text
    assert re.search(r'^\{"name": "final", "batch": 4, "state_path": "tinker://', text, flags=re.M)
    # the snippets, each run twice, each time a run of its own that says what it did
    assert len(set(re.findall(r"^(my-loop-\w+): loss \d", text, flags=re.M))) == 2
    assert len(set(re.findall(r"^(my-rl-\w+): 8 samples, mean reward", text, flags=re.M))) == 2
