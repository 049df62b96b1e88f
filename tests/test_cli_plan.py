"""`trainwire plan` and `trainwire inspect`: the happy path and the error table."""

import json
import subprocess
import sys

import pytest

from trainwire.cli import main
from trainwire.client import ManagedTrainingPlan, read_manifest

CONFIG = {
    "model": "tiny-bert",
    "task": "sequence-classification",
    "labels": ["negative", "positive"],
    "batch_size": 2,
}


@pytest.fixture
def inputs(tmp_path):
    examples = tmp_path / "train.jsonl"
    lines = [{"text": f"text {i}", "label": ["negative", "positive"][i % 2]} for i in range(5)]
    examples.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    return tmp_path, examples, config


def run_cli(*args):
    return main([str(a) for a in args])


def test_plan_writes_a_verifiable_manifest_and_inspect_describes_it(inputs, capsys):
    tmp_path, examples, config = inputs
    output = tmp_path / "out" / "manifest.json"
    assert run_cli("plan", "--examples", examples, "--config", config, "--output", output) == 0
    plan = ManagedTrainingPlan.from_manifest(read_manifest(output))
    assert plan.batch_count == 3
    assert run_cli("inspect", output) == 0
    text = capsys.readouterr().out
    assert plan.fingerprint in text and "(verified)" in text and "updates      3" in text


def test_plan_reads_yaml_and_applies_overrides(inputs):
    tmp_path, examples, _ = inputs
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: tiny-bert\ntask: sequence-classification\nlabels: [negative, positive]\n"
    )
    output = tmp_path / "m.json"
    args = ["plan", "--examples", examples, "--config", config, "--output", output]
    assert run_cli(*args, "--set", "batch_size=5", "--set", "lora.r=4") == 0
    plan = ManagedTrainingPlan.from_manifest(read_manifest(output))
    assert plan.config.batch_size == 5 and plan.config.lora.r == 4


@pytest.mark.parametrize(
    ("examples_text", "config_change", "overrides", "message"),
    [
        ('{"text": "a", "label": "positive"}\n{"text": \n', {}, [], r"train\.jsonl:2: "),
        ('{"label": "positive"}\n', {}, [], r"train\.jsonl:1: an example needs the field 'text'"),
        ('{"text": "a", "label": "neutral"}\n', {}, [], r"unknown label 'neutral'"),
        ("", {}, [], "the training dataset is empty"),
        (None, {"learnin_rate": 0.1}, [], "unknown config key.*learnin_rate"),
        (None, {"precision": "fp16"}, [], "fp16"),
        (None, {}, ["num_workers=2"], "num_workers"),
        (None, {}, ["batch_size"], "--set takes key=value"),
    ],
)
def test_plan_errors_are_one_line_with_exit_code_2(
    inputs, capsys, examples_text, config_change, overrides, message
):
    tmp_path, examples, config = inputs
    if examples_text is not None:
        examples.write_text(examples_text)
    config.write_text(json.dumps(CONFIG | config_change))
    output = tmp_path / "m.json"
    sets = [a for item in overrides for a in ("--set", item)]
    code = run_cli("plan", "--examples", examples, "--config", config, "--output", output, *sets)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("trainwire plan: error: ")
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err), err
    assert not output.exists(), "a refused plan writes nothing"


def test_a_tampered_manifest_is_shown_by_inspect_and_refused_with_the_fix(inputs, capsys):
    """Issue 24.7: inspect shows a hand-edited manifest (saying it does not verify), and what
    refuses it says to plan again."""
    tmp_path, examples, config = inputs
    output = tmp_path / "m.json"
    run_cli("plan", "--examples", examples, "--config", config, "--output", output)
    manifest = json.loads(output.read_text())
    manifest["config"]["seed"] = 7
    output.write_text(json.dumps(manifest))
    capsys.readouterr()
    assert run_cli("inspect", output) == 0
    shown = capsys.readouterr().out
    assert "DOES NOT VERIFY" in shown and "plan it again" in shown
    with pytest.raises(ValueError, match=r"fingerprint mismatch.*Plan it again"):
        ManagedTrainingPlan.from_manifest(read_manifest(output))


def test_eval_examples_that_would_never_be_used_are_refused(inputs, capsys):
    tmp_path, examples, config = inputs
    output = tmp_path / "m.json"
    code = run_cli(
        "plan", "--examples", examples, "--eval-examples", examples, "--config", config,
        "--output", output,
    )  # fmt: skip
    assert code == 2 and "eval_strategy is 'no'" in capsys.readouterr().err
    assert not output.exists()


def test_the_console_script_runs_as_a_module(inputs):
    tmp_path, examples, config = inputs
    output = tmp_path / "m.json"
    done = subprocess.run(
        [sys.executable, "-m", "trainwire", "plan", "--examples", str(examples),
         "--config", str(config), "--output", str(output)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "3 microbatches" in done.stdout
