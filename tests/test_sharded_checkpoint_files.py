"""A sharded checkpoint's files, read by the service in one process with no process group.

Two gloo ranks (``sharded_runs.save_checkpoints``, once for the module) write two SaveState
checkpoints into a run's folder, as a server with a sharded session would; this process then
verifies them to the state digest the ranks reported, finds each kind of damage, reads their
journal entries, falls back past a damaged one in recovery's choice, and inspects one.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sharded_workers as workers
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainwire.cli import main
from trainwire.server.engine.session.checkpoint import SESSION_FILE, read_extra, verify_checkpoint
from trainwire.server.engine.sharded.verify import verify_sharded_checkpoint
from trainwire.server.errors import InvalidArgument, NotFound
from trainwire.server.service.journal import JournalEntry
from trainwire.server.service.run_checkpoints import checkpoint_extra, latest_checkpoint
from trainwire.server.service.state_dir import RunDirectory

RUN_ID = "run"
POSITIONS = {"early": 2, "late": 5}  # the SaveStates' journal positions, oldest first


@dataclass(frozen=True)
class SavedRun:
    """A run folder (``<root>/runs/run``) holding the two checkpoints, and what they recorded."""

    root: Path
    extras: dict[str, dict]
    digests: dict[str, str]  # the state digest each rank reported right after each save

    def run(self, root: Path | None = None) -> RunDirectory:
        return RunDirectory((root or self.root) / "runs" / RUN_ID)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> SavedRun:
    """LoRA with dropout, so every rank's RNG takes part in the state digest."""
    root = tmp_path_factory.mktemp("sharded-state")
    run = RunDirectory(root / "runs" / RUN_ID)
    run.checkpoints.mkdir(parents=True)
    extras = {
        name: checkpoint_extra(
            RUN_ID, JournalEntry(f"save-{name}", "save_state", "sha256:0", position, {})
        )
        for name, position in POSITIONS.items()
    }
    saves = [{"path": str(run.checkpoint(name)), "extra": extra} for name, extra in extras.items()]
    spec = {
        "model": str(tiny_llama),
        "lora": True,
        "dropout": 0.1,
        "out": str(tmp_path_factory.mktemp("sharded-reports")),
        "saves": saves,
    }
    reports = workers.launch(2, "save_checkpoints", spec)
    assert reports[0] == reports[1]
    return SavedRun(root, extras, dict(zip(POSITIONS, reports[0]["digests"], strict=True)))


def _copy(saved: SavedRun, tmp_path: Path) -> RunDirectory:
    """The whole state folder copied, to damage without touching the module's checkpoints."""
    shutil.copytree(saved.root, tmp_path / "state")
    return saved.run(tmp_path / "state")


# -- damage ------------------------------------------------------------------------------------


def _flip_a_weight_byte(checkpoint: Path) -> None:
    """One byte of a tensor's own values changed; the shard still reads. DCP's index gives each
    record's place in its file (a ``torch.save`` record: headers, then the values)."""
    storage = dcp.FileSystemReader(checkpoint).read_metadata().storage_data
    where = max(storage.values(), key=lambda item: item.length)
    shard = checkpoint / where.relative_path
    data = bytearray(shard.read_bytes())
    record = bytes(data[where.offset : where.offset + where.length])
    values = torch.load(io.BytesIO(record), weights_only=True).numpy().tobytes()
    data[where.offset + record.index(values) + len(values) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _remove_a_shard_file(checkpoint: Path) -> None:
    (checkpoint / "__1_0.distcp").unlink()


def _truncate_the_index(checkpoint: Path) -> None:
    index = checkpoint / ".metadata"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])


def _edit_session_json(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(checkpoint: Path) -> None:
        meta = json.loads((checkpoint / SESSION_FILE).read_text())
        change(meta)
        (checkpoint / SESSION_FILE).write_text(json.dumps(meta))

    return edit


def _other_rng(meta: dict) -> None:
    meta["rng"][1] = meta["rng"][0]  # rank 1's RNG replaced by rank 0's


DAMAGE = {
    "flipped-shard-byte": (_flip_a_weight_byte, "checkpoint late is damaged: its shards hash to"),
    "removed-shard-file": (_remove_a_shard_file, r"late is damaged: .* does not read"),
    "truncated-index": (_truncate_the_index, "late is damaged: its shard index does not read"),
    "changed-step": (
        _edit_session_json(lambda meta: meta.update(step=meta["step"] + 1)),
        "checkpoint late is damaged: its shards hash to",
    ),
    "changed-rng": (_edit_session_json(_other_rng), "late is damaged: .* RNG states hash to"),
    "malformed-counter": (
        _edit_session_json(lambda meta: meta.update(accumulated="one")),
        f"late: malformed {SESSION_FILE}",
    ),
}


# -- one process, no process group -------------------------------------------------------------


@pytest.mark.slow
def test_a_sharded_checkpoint_verifies_in_one_process_to_its_recorded_state_digest(saved) -> None:
    assert not dist.is_initialized()
    for name, digest in saved.digests.items():
        checkpoint = saved.run().checkpoint(name)
        recorded = json.loads((checkpoint / SESSION_FILE).read_text())["state_digest"]
        assert verify_checkpoint(checkpoint) == verify_sharded_checkpoint(checkpoint)
        assert verify_checkpoint(checkpoint) == recorded == digest
    assert saved.digests["early"] != saved.digests["late"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_each_kind_of_damage_to_a_sharded_checkpoint_is_named(saved, tmp_path, damage) -> None:
    change, message = DAMAGE[damage]
    checkpoint = _copy(saved, tmp_path).checkpoint("late")
    change(checkpoint)
    with pytest.raises(InvalidArgument, match=message):
        verify_checkpoint(checkpoint)


def test_no_checkpoint_is_not_found(tmp_path) -> None:
    with pytest.raises(NotFound, match="no checkpoint at missing"):
        verify_sharded_checkpoint(tmp_path / "missing")
    with pytest.raises(NotFound, match="no checkpoint at missing"):
        verify_checkpoint(tmp_path / "missing")


@pytest.mark.slow
def test_read_extra_returns_the_extra_a_sharded_checkpoint_was_saved_with(saved) -> None:
    for name, extra in saved.extras.items():
        assert read_extra(saved.run().checkpoint(name)) == extra


@pytest.mark.slow
def test_recovery_falls_back_past_a_damaged_sharded_checkpoint_to_an_older_intact_one(
    saved, tmp_path
) -> None:
    intact = latest_checkpoint(saved.run(), RUN_ID)
    assert intact is not None and (intact.path.name, intact.position) == ("late", 5)

    run = _copy(saved, tmp_path)
    _flip_a_weight_byte(run.checkpoint("late"))
    damaged: list[str] = []
    point = latest_checkpoint(run, RUN_ID, damaged=damaged)

    assert point is not None and (point.path.name, point.position) == ("early", 2)
    assert point.skipped == ("late",) and damaged == ["late"]
    assert point.entry("save_state").operation_key == "save-early"


@pytest.mark.slow
def test_inspect_describes_a_sharded_checkpoint(saved, capsys) -> None:
    assert main(["inspect", str(saved.run().checkpoint("late"))]) == 0
    text = capsys.readouterr().out
    assert "format       trainwire.sharded-checkpoint/v1" in text
    assert "world size   2 " in text
    assert f"state digest {saved.digests['late']}" in text
    assert "server       run run, position 5, saved by save-late" in text
    assert "__1_0.distcp" in text and ".metadata" in text
