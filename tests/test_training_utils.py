"""The run-management utilities of trainwire.server.training, each guard's refusal included, on
real Lightning checkpoints written by real short runs."""

import json
import logging
import pickle

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger
from training_runs import classifier_plan, shared_run, stopping_plan

from trainwire.client import overrides
from trainwire.server.training import (
    CheckpointInfo,
    HardwareInfo,
    TrainingResult,
    constructor_settings,
    create_trainer,
    detect_hardware,
    effective_precision,
    get_gpu_memory_info,
    outcome_checkpoint,
    outcome_early_stopping,
    parse_config_overrides,
    read_checkpoint,
    refuse_a_fresh_start_into_a_used_directory,
    refuse_a_resume_from_another_directory,
    refuse_a_resume_of_a_stopped_run,
    refuse_a_resume_under_other_settings,
    refuse_other_constructor_settings,
    resolve_checkpoint,
    run_settings,
    save_training_summary,
)
from trainwire.server.training.callbacks import OutcomeCheckpoint

GIB = 1024**3


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, bert_classifier_config):
    return shared_run("bert", tmp_path_factory, classifier_plan(bert_classifier_config))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, bert_classifier_config):
    return shared_run("stopped", tmp_path_factory, stopping_plan(bert_classifier_config))


@pytest.fixture(scope="module")
def last(bert_run):
    return CheckpointInfo.read(bert_run.output / "checkpoints" / "last.ckpt")


def fake_gpu(monkeypatch, *, bf16=True):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (6 * GIB, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 1 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: GIB // 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **k: bf16)


# -- hardware and precision ----------------------------------------------------------------


def test_detect_hardware_prefers_cuda_then_mps_then_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    cpu = detect_hardware(cuda_precision="bf16-true")
    assert (cpu.accelerator, cpu.precision, cpu.memory) == ("cpu", "32-true", None)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert (detect_hardware(cuda_precision="bf16-true").accelerator, "mps") == ("mps", "mps")
    assert detect_hardware(cuda_precision="bf16-true").precision == "32-true"
    fake_gpu(monkeypatch)
    gpu = detect_hardware(cuda_precision="bf16-true")
    assert (gpu.accelerator, gpu.precision, gpu.device_name) == ("cuda", "bf16-true", "Fake GPU")
    assert gpu.device_count == 2 and gpu.memory["total_gb"] == 8.0


def test_detect_hardware_logs_what_it_found_when_asked(caplog):
    with caplog.at_level(logging.INFO, logger="trainwire.server.training.hardware"):
        detect_hardware()
        assert not caplog.records
        info = detect_hardware(log_info=True)
    assert f"hardware: {info.accelerator}" in caplog.text and info.precision in caplog.text


def test_gpu_memory_info_is_none_without_cuda_and_in_gb_with_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert get_gpu_memory_info() is None
    fake_gpu(monkeypatch)
    assert get_gpu_memory_info() == {
        "total_gb": 8.0,
        "reserved_gb": 1.0,
        "allocated_gb": 0.5,
        "free_gb": 6.0,
        "utilization_percent": 25.0,
    }


def test_effective_precision_is_fp32_everywhere_and_bf16_only_on_native_cuda(
    monkeypatch, bert_classifier_config
):
    fp32, bf16 = bert_classifier_config(), bert_classifier_config(precision="bf16")
    assert effective_precision(fp32, "cpu") == effective_precision(fp32, "cuda") == "32-true"
    with pytest.raises(ValueError, match=r"bf16 needs a CUDA device; this run trains on cpu.*fp32"):
        effective_precision(bf16, "cpu")
    fake_gpu(monkeypatch)
    assert effective_precision(bf16, "cuda") == "bf16-true"
    fake_gpu(monkeypatch, bf16=False)
    with pytest.raises(ValueError, match="Fake GPU has no native bf16; use precision fp32"):
        effective_precision(bf16, "cuda")


# -- settings --------------------------------------------------------------------------------


def test_parse_config_overrides_is_the_one_client_parser():
    assert parse_config_overrides is overrides.parse_config_overrides
    valid, invalid = parse_config_overrides(
        ["a=1", "b=TRUE", "c=1e-4", "d=[1, 2]", "e=null", "f={'x': 1}", "g=x=y", "h=text", "bad"]
    )
    assert valid == {
        "a": 1,
        "b": True,
        "c": 1e-4,
        "d": [1, 2],
        "e": None,
        "f": {"x": 1},
        "g": "x=y",
        "h": "text",
    }
    assert invalid == ["bad"]


def test_run_settings_come_in_a_fixed_order_of_json_types(bert_classifier_config):
    config = bert_classifier_config(gradient_accumulation_steps=4, max_grad_norm=None)
    settings = run_settings(config, accelerator="cpu", precision="32-true")
    assert list(settings)[:6] == [
        "accelerator",
        "devices",
        "precision",
        "gradient_accumulation_steps",
        "max_grad_norm",
        "num_epochs",
    ]
    assert settings["gradient_accumulation_steps"] == 4 and settings["max_grad_norm"] is None
    assert json.loads(json.dumps(settings)) == settings
    assert "seed" not in settings and "model" not in settings
    other = run_settings(config.replace(num_epochs=3), accelerator="cuda", precision="bf16-true")
    assert list(other) == list(settings) and other != settings


def test_constructor_settings_describe_the_model(bert_classifier_config, small_lora):
    full = constructor_settings(bert_classifier_config())
    assert full["task"] == "sequence-classification" and full["lora"] is False
    assert not any(key.startswith("lora.") for key in full)
    lora = constructor_settings(bert_classifier_config(lora=small_lora))
    assert lora["lora.r"] == 4 and lora["lora.alpha"] == 8 and lora["lora.dropout"] == 0.1
    assert lora["lora.target_modules"] == ["all-linear"] and lora["lora.use_dora"] is False
    assert lora["labels"] == ["negative", "positive"]
    assert json.loads(json.dumps(lora)) == lora


# -- checkpoints -----------------------------------------------------------------------------


def test_resolve_checkpoint_none_last_and_an_explicit_path(tmp_path):
    assert resolve_checkpoint(None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match=r"no last.ckpt in .*start a fresh run"):
        resolve_checkpoint("last", tmp_path)
    (tmp_path / "exp").mkdir()
    last = tmp_path / "exp" / "last.ckpt"
    last.write_bytes(b"")
    assert resolve_checkpoint("last", tmp_path, "exp") == last
    assert resolve_checkpoint("last.ckpt", tmp_path, "exp") == last
    assert resolve_checkpoint(str(last), tmp_path / "elsewhere") == last
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing.ckpt", tmp_path)


def test_read_checkpoint_loads_a_real_checkpoint_on_the_cpu(bert_run, last):
    checkpoint = read_checkpoint(last.path)
    scores = [v["best_model_score"] for v in checkpoint["callbacks"].values() if "dirpath" in v]
    assert scores and all(score.device.type == "cpu" for score in scores)
    assert last.cursor == last.batch_count == bert_run.plan.batch_count
    assert last.global_step == bert_run.plan.max_steps and not last.early_stopped
    assert last.state_digest == bert_run.result.state_digest
    assert last.session_checkpoint.is_dir() and last.session_checkpoint.parent == last.path.parent
    assert last.seed == 0 and last.output_dir == str(bert_run.output.resolve())
    assert json.loads(json.dumps(last.to_dict())) == last.to_dict()


class Payload:
    """Unpickling this creates a marker file: what a planted checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_read_checkpoint_refuses_a_planted_pickle_payload(tmp_path):
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(Payload(marker))).close()  # the payload is real
    assert marker.exists()
    marker.unlink()
    planted = tmp_path / "planted.ckpt"
    torch.save({"state_dict": {}, "payload": Payload(marker)}, planted)
    with pytest.raises(ValueError, match="refused: not a weights-only checkpoint"):
        read_checkpoint(planted)
    assert not marker.exists()


# -- guards ----------------------------------------------------------------------------------


def test_a_fresh_start_into_a_used_directory_is_refused(bert_run, tmp_path):
    with pytest.raises(ValueError, match=r"already holds a run's checkpoints \(best-.*last.ckpt"):
        refuse_a_fresh_start_into_a_used_directory(bert_run.output / "checkpoints")
    refuse_a_fresh_start_into_a_used_directory(tmp_path / "new")
    refuse_a_fresh_start_into_a_used_directory(tmp_path)


def test_a_resume_from_another_directory_is_refused_and_a_symlink_passes(bert_run, last, tmp_path):
    with pytest.raises(ValueError) as refused:
        refuse_a_resume_from_another_directory(last, tmp_path / "other")
    message = str(refused.value)
    assert f"belongs to the run in {bert_run.output.resolve()}, not to {tmp_path / 'other'}" in (
        message
    )
    assert f"resume it with --output {bert_run.output.resolve()}" in message
    link = tmp_path / "link"
    link.symlink_to(bert_run.output, target_is_directory=True)
    refuse_a_resume_from_another_directory(last, link)
    refuse_a_resume_from_another_directory(last, bert_run.output)


def test_a_resume_under_other_settings_names_each_setting_and_the_seed(last):
    refuse_a_resume_under_other_settings(last, last.settings, seed=last.seed)
    now = dict(last.settings, gradient_accumulation_steps=1, max_grad_norm=None, newcomer=True)
    del now["num_epochs"]
    with pytest.raises(ValueError) as refused:
        refuse_a_resume_under_other_settings(last, now, seed=5)
    message = str(refused.value)
    for difference in (
        "gradient_accumulation_steps: saved 2, now 1",
        "max_grad_norm: saved 1.0, now None",
        "num_epochs: saved 2, now absent",
        "newcomer: saved absent, now True",
        "seed: saved 0, now 5",
    ):
        assert difference in message
    assert "Resume with the settings it was saved with" in message
    with pytest.raises(ValueError, match="seed: saved 0, now absent"):
        refuse_a_resume_under_other_settings(last, last.settings, seed=None)


def test_a_resume_of_a_run_early_stopping_ended_is_refused(stopped_run, last):
    refuse_a_resume_of_a_stopped_run(last)
    stopped = CheckpointInfo.read(stopped_run.output / "checkpoints" / "last.ckpt")
    assert stopped.early_stopped and stopped.cursor < stopped.batch_count
    with pytest.raises(ValueError) as refused:
        refuse_a_resume_of_a_stopped_run(stopped)
    message = str(refused.value)
    assert "early stopping ended that run at update 4 after 1 evaluation(s) without gain" in message
    assert "nothing to resume" in message and "new --output directory" in message


def test_other_constructor_settings_are_refused(last, bert_classifier_config, small_lora):
    same = bert_classifier_config(model=last.constructor_settings["model"])
    refuse_other_constructor_settings(last.constructor_settings, constructor_settings(same))
    lora = constructor_settings(same.replace(lora=small_lora, labels=("bad", "good")))
    with pytest.raises(ValueError) as refused:
        refuse_other_constructor_settings(last.constructor_settings, lora, what="last.ckpt")
    message = str(refused.value)
    assert message.startswith("last.ckpt was trained in another model: ")
    assert "labels: saved ['negative', 'positive'], now ['bad', 'good']" in message
    assert "lora: saved False, now True" in message and "lora.r: saved absent, now 4" in message


# -- callbacks, trainer, summary -------------------------------------------------------------


class ScriptedMetric(pl.LightningModule):
    """One batch an epoch that logs the next scripted ``eval_loss``."""

    def __init__(self, values):
        super().__init__()
        self.values = values
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader([0], batch_size=None)

    def training_step(self, batch, batch_idx):
        value = self.values[self.current_epoch]
        self.log("eval_loss", torch.tensor(value, dtype=torch.float64), on_step=True)
        return (self.weight * 0.0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_scripted(values, callbacks, root):
    trainer = pl.Trainer(
        max_epochs=len(values),
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, OutcomeCheckpoint) for c in callbacks),
        default_root_dir=root,
    )
    trainer.fit(ScriptedMetric(values))
    return trainer


def test_outcome_checkpoint_keeps_the_earliest_best_epoch_and_last(tmp_path):
    checkpoint = outcome_checkpoint(tmp_path / "ckpt")
    fit_scripted([0.5, 0.3, 0.3, 0.4], [checkpoint], tmp_path)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["best-epoch=1-step=2.ckpt", "last.ckpt"]
    assert checkpoint.best_model_score.item() == 0.3
    assert read_checkpoint(tmp_path / "ckpt" / "last.ckpt")["epoch"] == 3
    maximum = outcome_checkpoint(tmp_path / "max", mode="max")
    fit_scripted([0.5, 0.7, 0.7, 0.4], [maximum], tmp_path)
    assert sorted(p.name for p in (tmp_path / "max").iterdir())[0] == "best-epoch=1-step=2.ckpt"


def test_outcome_early_stopping_counts_a_tie_against_patience(tmp_path):
    stopping = outcome_early_stopping(1)
    assert stopping.min_delta == 0
    assert fit_scripted([0.5, 0.5, 0.4], [stopping], tmp_path).current_epoch == 2  # the tie
    assert stopping.stopped_epoch == 1
    patient = outcome_early_stopping(2)
    trainer = fit_scripted([0.5, 0.4, 0.4, 0.3, 0.3, 0.3, 0.1], [patient], tmp_path)
    assert patient.stopped_epoch == 5 and trainer.current_epoch == 6


def test_create_trainer_uses_one_device_the_detected_precision_and_the_outcome_callbacks(
    tmp_path,
):
    hardware = detect_hardware()
    trainer = create_trainer(tmp_path, hardware=hardware, monitor="eval_accuracy", mode="max")
    assert trainer.num_devices == 1 and trainer.precision == hardware.precision
    (checkpoint,) = [c for c in trainer.callbacks if isinstance(c, OutcomeCheckpoint)]
    assert checkpoint.monitor == "eval_accuracy" and checkpoint.mode == "max"
    assert checkpoint.dirpath == str(tmp_path / "checkpoints")
    assert not any(isinstance(c, EarlyStopping) for c in trainer.callbacks)
    assert isinstance(trainer.logger, CSVLogger) and trainer.logger.save_dir == str(tmp_path)
    stopping = create_trainer(tmp_path, hardware=hardware, patience=3)
    (early,) = [c for c in stopping.callbacks if isinstance(c, EarlyStopping)]
    assert early.patience == 3 and early.monitor == "eval_loss"
    with pytest.raises(ValueError, match="logger must be one of csv, tensorboard"):
        create_trainer(tmp_path, hardware=hardware, logger="wandb")


def test_save_training_summary_writes_json_and_yaml_with_the_final_digest(
    tmp_path, bert_classifier_config
):
    result = TrainingResult(best_score=0.5, best_step=3, state_digest="sha256:" + "0" * 64)
    config = bert_classifier_config()
    hardware = HardwareInfo("cpu", "32-true", "cpu", 1, "2.x")
    written = save_training_summary(result, config, hardware, tmp_path, extra={"runner": "test"})
    assert [p.name for p in written] == ["training_summary.json", "training_summary.yaml"]
    summary = json.loads(written[0].read_text())
    assert yaml.safe_load(written[1].read_text()) == summary
    assert summary["state_digest"] == result.state_digest and summary["runner"] == "test"
    assert summary["result"] == result.to_dict() and summary["config"] == config.to_dict()
    assert summary["hardware"]["accelerator"] == "cpu"
    only_yaml = save_training_summary(result, config, None, tmp_path / "y", format="yaml")
    assert [p.name for p in only_yaml] == ["training_summary.yaml"]
    with pytest.raises(ValueError, match="summary format must be one of json, yaml, both"):
        save_training_summary(result, config, None, tmp_path, format="xml")
