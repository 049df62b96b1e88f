"""`trainwire train`: a manifest run locally through Lightning ends with the same bits as the plan
driven op by op, resumes exactly from `last`, and refuses the resumes it must refuse, changing
nothing."""

import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml
from training_runs import (
    StopAfter,
    classifier_plan,
    lora_plan,
    op_by_op,
    references,
    shared_run,
    snapshot,
    stopping_plan,
    write_manifest,
)

from trainwire.cli import main
from trainwire.server.training import TrainCheckpointRecord, read_checkpoint
from trainwire.server.training.callbacks import StopOnInterrupt
from trainwire.server.training.run import train


@pytest.fixture(scope="module")
def plans(bert_classifier_config, llama_config, small_lora):
    return {
        "full": classifier_plan(bert_classifier_config),
        "lora": lora_plan(llama_config, small_lora),
    }


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, plans):
    return shared_run(tmp_path_factory, plans["full"])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, bert_classifier_config):
    return shared_run(tmp_path_factory, stopping_plan(bert_classifier_config))


def run_cli(*args):
    return main(["train", *(str(a) for a in args)])


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_train_ends_with_the_digest_of_the_plan_driven_op_by_op(kind, plans, tmp_path, capsys):
    plan = plans[kind]
    manifest = write_manifest(tmp_path, plan)
    output = tmp_path / "out"
    assert run_cli("--manifest", manifest, "--output", output, "--device", "cpu") == 0

    summary = json.loads((output / "training_summary.json").read_text())
    expected, reference = references(plan)
    assert summary["state_digest"] == expected
    assert yaml.safe_load((output / "training_summary.yaml").read_text()) == summary
    assert expected in capsys.readouterr().out
    # The in-process replay (the loop the controller shares) decides the same, step by step.
    assert summary["result"]["state_digest"] == reference.state_digest
    assert summary["result"]["history"] == reference.history
    assert summary["result"]["best_step"] == reference.best_step
    assert (output / "export" / "trainwire_export.json").is_file()
    assert (output / "logs" / "version_0" / "metrics.csv").is_file()
    # One summary schema for every runner; a local run adds the hardware it trained on.
    assert summary["format"] == "trainwire.summary/v1" and summary["runner"] == "lightning"
    assert summary["manifest_fingerprint"] == plan.fingerprint
    assert summary["hardware"]["accelerator"] == "cpu"
    assert summary["result"]["config_path"] == str(manifest.resolve())
    assert (output / "metrics.jsonl").is_file() and (output / "loss_curve.png").is_file()


@pytest.mark.parametrize(("kind", "stop_after"), [("full", 3), ("lora", 4)])
def test_resume_from_last_mid_accumulation_equals_the_uninterrupted_run(
    kind, stop_after, plans, tmp_path
):
    plan = plans[kind]
    manifest = write_manifest(tmp_path, plan)
    output = tmp_path / "out"
    interrupted = train(manifest, output, device="cpu", callbacks=[StopAfter(stop_after)])
    assert not (output / "training_summary.json").exists()
    info = TrainCheckpointRecord.read(output / "checkpoints" / "last.ckpt")
    assert info.cursor == stop_after and not plan.is_update(stop_after - 1)
    assert len(info.record["run_state"]["pending_losses"]) == 1  # gradients pending
    assert info.state_digest == interrupted.state_digest

    assert run_cli("--manifest", manifest, "--output", output, "--ckpt-path", "last") == 0
    summary = json.loads((output / "training_summary.json").read_text())
    expected, reference = references(plan)
    assert summary["state_digest"] == expected
    assert summary["result"]["history"] == reference.history


class InterruptAfter(pl.Callback):
    """Sends this process a Ctrl-C after ``count`` microbatches."""

    def __init__(self, count):
        self.count = count
        self.seen = 0

    def on_train_batch_end(self, trainer, *args):
        self.seen += 1
        if self.seen == self.count:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_stops_after_the_microbatch_in_flight_and_the_run_resumes_exactly(plans, tmp_path):
    plan = plans["full"]
    manifest = write_manifest(tmp_path, plan)
    output = tmp_path / "out"
    handler = signal.getsignal(signal.SIGINT)
    interrupt = StopOnInterrupt()
    train(manifest, output, device="cpu", callbacks=[interrupt, InterruptAfter(3)])
    assert interrupt.requested and signal.getsignal(signal.SIGINT) is handler
    assert TrainCheckpointRecord.read(output / "checkpoints" / "last.ckpt").cursor == 4

    result = train(manifest, output, device="cpu", ckpt_path="last")
    assert result.state_digest == references(plan)[0]


def test_resuming_a_run_early_stopping_ended_is_refused_and_changes_nothing(stopped_run, capsys):
    assert stopped_run.result.early_stopped
    assert stopped_run.result.stopped_epoch == 1 < stopped_run.plan.config.num_epochs - 1
    assert stopped_run.result.state_digest == op_by_op(stopped_run.plan)
    # Lightning's early stopping took the same decision: one evaluation without gain.
    checkpoint = read_checkpoint(stopped_run.output / "checkpoints" / "last.ckpt")
    (stopping,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("EarlyStopping")]
    assert stopping["wait_count"] == 1
    before = snapshot(stopped_run.output)

    args = ("--manifest", stopped_run.manifest, "--output", stopped_run.output)
    assert run_cli(*args, "--ckpt-path", "last") == 2
    error = capsys.readouterr().err
    assert "early stopping ended that run" in error and "new --output directory" in error
    assert snapshot(stopped_run.output) == before


def test_a_resume_under_other_settings_names_them_and_changes_nothing(bert_run, capsys):
    before = snapshot(bert_run.output)
    args = ("--manifest", bert_run.manifest, "--output", bert_run.output, "--ckpt-path", "last")
    assert run_cli(*args, "--set", "gradient_accumulation_steps=1", "--set", "seed=7") == 2
    error = capsys.readouterr().err
    assert "gradient_accumulation_steps: saved 2, now 1" in error
    assert "seed: saved 0, now 7" in error
    assert "manifest_fingerprint: saved" in error
    assert snapshot(bert_run.output) == before


def test_resuming_a_run_that_spent_its_epoch_budget_trains_nothing_and_changes_nothing(
    bert_run, capsys
):
    before = snapshot(bert_run.output)
    args = ("--manifest", bert_run.manifest, "--output", bert_run.output, "--ckpt-path", "last")
    assert run_cli(*args) == 0
    assert bert_run.result.state_digest in capsys.readouterr().out
    assert snapshot(bert_run.output) == before


def test_a_fresh_start_into_a_used_directory_is_refused(bert_run, capsys):
    before = snapshot(bert_run.output)
    assert run_cli("--manifest", bert_run.manifest, "--output", bert_run.output) == 2
    assert "already holds a run's checkpoints" in capsys.readouterr().err
    assert snapshot(bert_run.output) == before


def test_a_resume_into_another_directory_is_refused_but_a_symlink_to_it_passes(
    bert_run, tmp_path, capsys
):
    before = snapshot(bert_run.output)
    last = bert_run.output / "checkpoints" / "last.ckpt"
    other = tmp_path / "other"
    assert run_cli("--manifest", bert_run.manifest, "--output", other, "--ckpt-path", last) == 2
    error = capsys.readouterr().err
    assert f"belongs to the run in {bert_run.output / 'checkpoints'}" in error
    assert f"--output {bert_run.output}" in error
    assert not other.exists()

    link = tmp_path / "link"
    link.symlink_to(bert_run.output, target_is_directory=True)
    assert run_cli("--manifest", bert_run.manifest, "--output", link, "--ckpt-path", "last") == 0
    assert snapshot(bert_run.output) == before


def test_bad_overrides_and_missing_checkpoints_are_one_line_errors(bert_run, tmp_path, capsys):
    args = ("--manifest", bert_run.manifest, "--output", tmp_path / "new")
    assert run_cli(*args, "--set", "learning_rate") == 2
    assert "--set takes key=value, got: learning_rate" in capsys.readouterr().err
    assert run_cli(*args, "--ckpt-path", "last") == 2
    assert "no last.ckpt in" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_evaluation_every_few_steps_and_early_stopping_mid_epoch_match_the_replay(
    bert_classifier_config, tmp_path
):
    plan = classifier_plan(
        bert_classifier_config,
        gradient_accumulation_steps=1,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=2,
        metric_for_best="eval_accuracy",
        early_stopping=True,
        early_stopping_patience=2,
    )
    result = train(write_manifest(tmp_path, plan), tmp_path / "out", device="cpu")
    expected, reference = references(plan)
    assert result.early_stopped and result.stopped_step < plan.max_steps
    assert result.state_digest == expected
    assert result.history == reference.history
    assert result.best_step == reference.best_step
    assert result.best_checkpoint_path.endswith(f"best-epoch=0-step={reference.best_step}.ckpt")


def test_the_model_resolves_under_model_root(bert_classifier_config, model_root, tmp_path, capsys):
    """Issue 24.7: ``train`` resolves the config's model under ``--model-root`` as a server does,
    and says relative to what it looked when the model is not there."""
    plan = classifier_plan(bert_classifier_config)
    named = plan.config.replace(model=Path(plan.config.model).name)
    relative = type(plan)(plan.examples, named, eval_examples=plan.eval_examples)
    manifest = write_manifest(tmp_path, relative)
    out = tmp_path / "out"
    assert run_cli("--manifest", manifest, "--output", out, "--model-root", model_root) == 0
    assert "state_digest" in capsys.readouterr().out
