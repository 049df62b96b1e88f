"""Issue 15, items 2 and 5: replacing a checkpoint is atomic, leftovers are cleaned at start, and
a damaged latest checkpoint falls back to the newest intact one.

The replacement tests drive ``atomic_directory`` directly (it writes checkpoints, exports and
downloads); a crash is a child process that dies with ``os._exit`` at the worst moment, and the
state directory opened after it (what a restarted server does first) must show a whole
checkpoint under its name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainwire.contract import files
from trainwire.contract.files import atomic_directory
from trainwire.server.service import operations as ops
from trainwire.server.service.requests import CheckpointRequest
from trainwire.server.service.state_dir import StateDirectory


def _write_version(folder: Path, content: str) -> None:
    (folder / "weights.bin").write_text(content)
    (folder / "session.json").write_text(f'{{"version": "{content}"}}')


def _checkpoints(state: Path) -> Path:
    folder = state / "runs" / "run" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _visible(folder: Path) -> dict[str, str]:
    """What recovery sees: each listed checkpoint's version."""
    run = StateDirectory(folder.parents[2])
    try:
        listed = run.run("run").checkpoint_paths()
        return {path.name: (path / "weights.bin").read_text() for path in listed}
    finally:
        run.release()


@pytest.fixture(params=["exchange", "fallback"])
def swap_mode(request, monkeypatch) -> str:
    """Both ways a replacement swaps: the kernel's atomic exchange, and the portable fallback
    (two renames) where the filesystem has none."""
    if request.param == "fallback":
        monkeypatch.setattr(files, "exchange_paths", lambda a, b: False, raising=False)
    return request.param


CRASHED = 17  # the child's exit code when it died where it was aimed
NO_EXCHANGE = 3  # the child's exit code when this filesystem cannot exchange
CRASH_IN_THE_SWAP = textwrap.dedent(
    f"""
    import os, sys
    from pathlib import Path
    from trainwire.contract import files

    target, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "fallback":
        files.exchange_paths = lambda a, b: False
        real_replace = os.replace

        def replace(src, dst):
            # Die where the new directory would take the name: the old one is moved aside.
            if Path(dst) == target and ".tmp-" in Path(src).name:
                os._exit({CRASHED})
            real_replace(src, dst)

        os.replace = replace
    else:
        real_exchange = files.exchange_paths

        def exchange(a, b):
            # Die right after the kernel swapped them: the old directory waits under the
            # temporary's name for a cleanup that never came.
            if not real_exchange(a, b):
                os._exit({NO_EXCHANGE})
            os._exit({CRASHED})

        files.exchange_paths = exchange
    with files.atomic_directory(target) as tmp:
        (tmp / "weights.bin").write_text("new")
        (tmp / "session.json").write_text('{{"version": "new"}}')
    """
)
# What a restart sees after each crash: the exchange had swapped in the new directory; the
# fallback had moved the old one aside, and the restart's cleanup puts it back.
VISIBLE_AFTER_CRASH = {"exchange": {"latest": "new"}, "fallback": {"latest": "old"}}


def test_a_crash_while_a_checkpoint_is_replaced_leaves_a_whole_one_visible(tmp_path, swap_mode):
    folder = _checkpoints(tmp_path / "state")
    with atomic_directory(folder / "latest") as tmp:
        _write_version(tmp, "old")

    child = subprocess.run(
        [sys.executable, "-c", CRASH_IN_THE_SWAP, str(folder / "latest"), swap_mode],
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == CRASHED, f"the child did not crash in the swap ({child})"
    assert len(list(folder.iterdir())) == 2, "the crash left no half-done swap to clean"

    visible = _visible(folder)  # opening the state directory is a restart
    assert visible == VISIBLE_AFTER_CRASH[swap_mode]
    assert sorted(p.name for p in folder.iterdir()) == ["latest"], "leftovers were not cleaned"


def test_a_failed_swap_leaves_the_old_checkpoint_in_place(tmp_path, swap_mode, monkeypatch):
    folder = _checkpoints(tmp_path / "state")
    with atomic_directory(folder / "latest") as tmp:
        _write_version(tmp, "old")
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == folder / "latest" and ".tmp-" in Path(src).name:
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    monkeypatch.setattr(
        files,
        "exchange_paths",
        lambda a, b: (
            (_ for _ in ()).throw(OSError(5, "Input/output error"))
            if swap_mode == "exchange"
            else False
        ),
        raising=False,
    )
    with (
        pytest.raises(OSError, match="Input/output error"),
        atomic_directory(folder / "latest") as tmp,
    ):
        _write_version(tmp, "new")

    assert sorted(p.name for p in folder.iterdir()) == ["latest"]
    assert (folder / "latest" / "weights.bin").read_text() == "old"


def test_replacing_keeps_no_second_copy_and_reads_the_new_one(tmp_path, swap_mode):
    folder = _checkpoints(tmp_path / "state")
    for version in ("one", "two", "three"):
        with atomic_directory(folder / "latest") as tmp:
            _write_version(tmp, version)
    assert sorted(p.name for p in folder.iterdir()) == ["latest"]
    assert (folder / "latest").is_dir() and not (folder / "latest").is_symlink()
    assert (folder / "latest" / "weights.bin").read_text() == "three"


def test_the_state_directory_cleans_leftovers_at_start_and_puts_back_a_hidden_old_one(tmp_path):
    state = tmp_path / "state"
    checkpoints = _checkpoints(state)
    exports = state / "runs" / "run" / "exports"
    exports.mkdir()
    # A replacement of "latest" died after moving the old one aside: only the hidden copy is left.
    hidden = checkpoints / ".latest.old-k3j4l5m6" / "latest"
    hidden.mkdir(parents=True)
    _write_version(hidden, "old")
    # "best" was replaced, but the old copy was never removed.
    for folder in (checkpoints / "best", checkpoints / ".best.old-a1b2c3d4" / "best"):
        folder.mkdir(parents=True)
        _write_version(folder, "best")
    (checkpoints / ".best.tmp-zz9y8x7w").mkdir()  # an unfinished write
    (exports / ".final.tmp-q1w2e3r4").mkdir()
    (exports / "final").mkdir()

    assert _visible(checkpoints) == {"best": "best", "latest": "old"}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best", "latest"]
    assert sorted(p.name for p in exports.iterdir()) == ["final"]


# -- item 5: a damaged latest checkpoint falls back to the newest intact one ----------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path: Path) -> None:
    """Still a readable safetensors file, but one tensor's bits changed."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "file"),
    [(_truncate, "model.safetensors"), (_flip_last_byte, "optimizer.safetensors")],
    ids=["truncated-weights", "changed-optimizer-bits"],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(
    host, make_host, caplog, damage, file
):
    from host_operations import op, run_ops

    run_ops(host, 0, 1)
    intact = host.apply(ops.SAVE_STATE, CheckpointRequest("early"), op("save-early", 2))
    run_ops(host, 3, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("late"), op("save-late", 5))
    host.release()
    late = host.state_dir.run("run").checkpoint("late")
    damage(late / file)

    restarted = make_host()
    info = restarted.info()

    assert info.state == "open"
    assert (info.position, info.restored_checkpoint, info.last_operation_key) == (
        3,
        "early",
        "save-early",
    )
    assert info.state_digest == intact.state_digest
    assert info.damaged_checkpoints == ("late",)  # Info says a fallback happened
    assert "checkpoint late is damaged" in caplog.text
    assert "restored early instead" in caplog.text
    assert (late / file).exists(), "a damaged checkpoint is kept for a look, never deleted"


def test_recovery_with_every_checkpoint_damaged_starts_from_the_beginning_and_says_so(
    host, make_host, caplog
):
    from host_operations import op, run_ops

    run_ops(host, 0, 1)
    host.apply(ops.SAVE_STATE, CheckpointRequest("only"), op("save", 2))
    host.release()
    _truncate(host.state_dir.run("run").checkpoint("only") / "gradients.safetensors")

    info = make_host().info()

    assert (info.state, info.position, info.restored_checkpoint) == ("open", 0, "")
    assert info.damaged_checkpoints == ("only",)
    assert "checkpoint only is damaged" in caplog.text
