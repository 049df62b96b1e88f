"""A sharded session's weights alone, in and out: a checkpoint's export and ``load_weights``.

Two gloo ranks (``sharded_runs.weights_in_and_out``, once for the module) train, checkpoint
and export, export the checkpoint after training on, and load weights from each kind of source
into a fresh session. One process here writes the single-process checkpoint they also take, and
computes what they should see. The export of a checkpoint is the export taken when it was saved,
file for file; a loaded export gives the logprobs of the session it came from, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sharded_runs as runs
import sharded_workers as workers

from trainwire.server.engine.session import TrainingSession
from trainwire.server.engine.sharded.weights import raise_alike
from trainwire.server.engine.weights.transfer import ADAPTER_CONFIG_FILE, EXPORT_FILE
from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound
from trainwire.testing import make_tiny_model

MODES = ("full", "lora")


@dataclass(frozen=True)
class WeightsRun:
    out: Path  # the ranks' files, one folder per mode
    one_process: dict[str, Path]  # per mode: one process's checkpoint folder, its export beside
    expected: dict[str, dict[str, Any]]  # per mode: what one process saw (weights_seen)
    reports: list[dict[str, Any]]  # each rank's report, in rank order


def _one_process(config: Any, folder: Path, native: Path) -> dict[str, Any]:
    """One process's checkpoint and its export, and what one process's weights loads give."""
    session = TrainingSession(config, max_steps=workers.MAX_STEPS)
    workers.two_more_steps(session)
    session.save_state(folder / "checkpoint")
    session.export_checkpoint_weights(folder / "checkpoint", folder / "export")
    expected = {"one_process_saved": runs.weights_seen(session)}
    loaded = TrainingSession(config, max_steps=workers.MAX_STEPS)
    loaded.load_weights(native)
    expected["native_loaded"] = runs.weights_seen(loaded)
    return expected


@pytest.fixture(scope="module")
def weights_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, model_root: Path):
    native = make_tiny_model(model_root / "llama-seed1-shards", seed=1, shards=3)
    wrong_shape = make_tiny_model(model_root / "llama-small", size="small")
    root = tmp_path_factory.mktemp("sharded-weights")
    one_process, expected = {}, {}
    for mode in MODES:
        config = workers.make_config(str(tiny_llama), mode == "lora")
        expected[mode] = _one_process(config, root / "one-process" / mode, native)
        one_process[mode] = root / "one-process" / mode / "checkpoint"
    spec = {
        "model": str(tiny_llama),
        "out": str(root / "ranks"),
        "one_process": {mode: str(path) for mode, path in one_process.items()},
        "native": str(native),
        "wrong_shape": str(wrong_shape),
    }
    reports = workers.launch(2, "weights_in_and_out", spec)
    return WeightsRun(root / "ranks", one_process, expected, reports)


def _adapter_config(directory: Path) -> dict[str, Any]:
    config = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}


def _hashes(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


# -- exporting a checkpoint --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_checkpoints_export_is_the_export_taken_when_it_was_saved(
    weights_run, mode
) -> None:
    """Every file the same bytes; the record adds the checkpoint's name, as one process's does."""
    at_save, exported = (
        weights_run.out / mode / "at-save",
        weights_run.out / mode / "from-checkpoint",
    )
    expected, found = _hashes(at_save), _hashes(exported)
    assert EXPORT_FILE in found and len(found) > 3
    assert {n: h for n, h in found.items() if n != EXPORT_FILE} == {
        n: h for n, h in expected.items() if n != EXPORT_FILE
    }
    record = json.loads((exported / EXPORT_FILE).read_text())
    assert record == {**json.loads((at_save / EXPORT_FILE).read_text()), "checkpoint": "checkpoint"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_exporting_a_checkpoint_leaves_every_ranks_live_state_alone(weights_run, mode) -> None:
    assert [report[mode]["untouched"] for report in weights_run.reports] == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_one_process_checkpoint_exports_on_two_ranks_as_one_process_exports_it(
    weights_run, mode
) -> None:
    """File for file; adapter_config.json as PEFT reads it, its module sets in any order (PEFT
    writes a set in the order of the process's string hashing, unless the export sorts it)."""
    expected = weights_run.one_process[mode].parent / "export"
    found = weights_run.out / mode / "from-one-process"
    assert _hashes(found).keys() == _hashes(expected).keys()
    for name, digest in _hashes(found).items():
        if name == ADAPTER_CONFIG_FILE:
            assert _adapter_config(found) == _adapter_config(expected)
        else:
            assert digest == _hashes(expected)[name], name


@pytest.mark.slow
def test_a_missing_checkpoint_is_refused_alike_on_every_rank(weights_run) -> None:
    first, second = (report["full"]["missing"] for report in weights_run.reports)
    assert first == second
    assert first.startswith(f"{NotFound.__name__}: no checkpoint at none")


# -- load_weights ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_loaded_export_gives_the_exported_sessions_logprobs_exactly(weights_run, mode) -> None:
    for report in weights_run.reports:
        assert report[mode]["export_loaded"] == {**report[mode]["saved"], "step": 0}
    assert weights_run.reports[0][mode] == weights_run.reports[1][mode]  # every rank saw it


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_of_either_format_load_their_weights_and_keep_the_runs_step(
    weights_run, mode
) -> None:
    report = weights_run.reports[0][mode]
    assert report["checkpoint_loaded"] == {**report["saved"], "step": 0}
    one_process = weights_run.expected[mode]["one_process_saved"]
    assert report["one_process_loaded"]["parameters"] == one_process["parameters"]
    assert report["one_process_loaded"]["step"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_safetensors_model_loads_as_in_one_process(weights_run, mode) -> None:
    """The same parameters and base fingerprint (a full model seeds a LoRA session's base)."""
    loaded = weights_run.reports[0][mode]["native_loaded"]
    expected = weights_run.expected[mode]["native_loaded"]
    assert (loaded["parameters"], loaded["base"]) == (expected["parameters"], expected["base"])
    assert loaded["parameters"] != weights_run.reports[0][mode]["saved"]["parameters"]
    if mode == "lora":
        assert loaded["base"] != weights_run.reports[0][mode]["saved"]["base"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_wrong_shape_source_is_refused_on_every_rank_before_anything_changes(
    weights_run, mode
) -> None:
    for report in weights_run.reports:
        assert report[mode]["wrong_shape"].startswith("InvalidArgument: the weights do not fit")
        assert "shape" in report[mode]["wrong_shape"]
        assert report[mode]["unchanged"]


@pytest.mark.slow
def test_a_sharded_checkpoint_of_other_settings_is_refused_on_every_rank(weights_run) -> None:
    """A full-weights run's checkpoint in a LoRA session: what one process says of its own."""
    for report in weights_run.reports:
        assert report["lora"]["other_settings"].startswith(
            "InvalidArgument: checkpoint checkpoint was trained with other settings: lora"
        )
        assert report["lora"]["unchanged"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_load_failing_midway_leaves_every_rank_broken(weights_run, mode) -> None:
    for report in weights_run.reports:
        assert report[mode]["midway"] == "RuntimeError: pulled midway"
        assert report[mode]["broken"].startswith("load_weights failed midway")


# -- agreeing on an outcome, without processes -------------------------------------------------


class _Gathered:
    """A group whose ranks' outcomes are given: what ``raise_alike`` gathers."""

    def __init__(self, outcomes: list[Any]) -> None:
        self.outcomes = outcomes

    def gather(self, value: Any) -> list[Any]:
        return self.outcomes


def test_a_rank_raises_the_refusal_another_rank_met_with_its_class_and_message() -> None:
    with pytest.raises(InvalidArgument, match=r"^checkpoint c does not fit$"):
        raise_alike(_Gathered([("InvalidArgument", "checkpoint c does not fit"), None]), None)
    with pytest.raises(FailedPrecondition, match=r"^rank 0 failed: OSError: disk gone$"):
        raise_alike(_Gathered([("OSError", "disk gone"), None]), None)
    with pytest.raises(OSError, match="its own"):
        raise_alike(_Gathered([None, ("OSError", "its own")]), OSError("its own"))
    raise_alike(_Gathered([None, None]), None)  # nobody failed: nothing raised
