"""The run-management utilities of trainwire.server.training, each guard's refusal included, on
the dicts ``read_checkpoint`` returns for real checkpoints of real ``trainwire train`` runs."""

import json
import logging
import pickle
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.loggers import CSVLogger
from training_runs import classifier_plan, last_checkpoint, shared_run

from trainwire.contract.planning import overrides
from trainwire.server.training import (
    CheckpointInfo,
    HardwareInfo,
    TrainCheckpointRecord,
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
    resolve_checkpoint,
    run_settings,
    save_training_summary,
)
from trainwire.server.training.callbacks import OutcomeCheckpoint

GIB = 1024**3


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, bert_classifier_config):
    return shared_run(tmp_path_factory, classifier_plan(bert_classifier_config))


@pytest.fixture(scope="module")
def last(bert_run):
    """The bert run's last checkpoint, as the guards take it: ``read_checkpoint``'s dict."""
    return read_checkpoint(last_checkpoint(bert_run))


def settings_of(run):
    return run_settings(run.plan.config, accelerator="cpu", precision="32-true")


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
    assert (cpu.accelerator, cpu.precision, cpu.num_devices, cpu.gpu_memory) == (
        "cpu",
        "32-true",
        1,
        None,
    )
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert detect_hardware(cuda_precision="bf16-true").accelerator == "mps"
    assert detect_hardware(cuda_precision="bf16-true").precision == "32-true"
    fake_gpu(monkeypatch)
    gpu = detect_hardware(cuda_precision="bf16-true")
    assert (gpu.accelerator, gpu.precision, gpu.device_name) == ("cuda", "bf16-true", "Fake GPU")
    assert gpu.num_devices == 2 and gpu.gpu_memory["total_gb"] == 8.0
    assert detect_hardware().precision == "bf16-mixed"  # the seed's default on CUDA


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
    # Refused off CUDA, never downgraded: the one deliberate difference from the seed.
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
    assert parse_config_overrides(None) == ({}, [])
    assert overrides.checked_config_overrides(["a=1"]) == {"a": 1}
    with pytest.raises(ValueError, match="--set takes key=value, got: bad, also"):
        overrides.checked_config_overrides(["a=1", "bad", "also"])


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
    assert resolve_checkpoint(None, tmp_path, "exp") == CheckpointInfo(None, False, False)
    assert resolve_checkpoint("last", tmp_path, "exp") == CheckpointInfo(None, False, False)
    (tmp_path / "exp").mkdir()
    last = tmp_path / "exp" / "last.ckpt"
    last.write_bytes(b"")
    assert resolve_checkpoint("last", tmp_path, "exp") == CheckpointInfo(str(last), True, True)
    assert resolve_checkpoint("last.ckpt", tmp_path, "exp") == CheckpointInfo(str(last), True, True)
    elsewhere = resolve_checkpoint(str(last), tmp_path, "other")
    assert elsewhere == CheckpointInfo(str(last), False, True)
    # Stricter than the seed: a mistyped path is an error, never a silent fresh start.
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt does not exist"):
        resolve_checkpoint(tmp_path / "missing.ckpt", tmp_path, "exp")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        resolve_checkpoint(tmp_path / "exp", tmp_path, "exp")


def test_read_checkpoint_loads_a_real_checkpoint_on_the_cpu(bert_run, last):
    scores = [v["best_model_score"] for v in last["callbacks"].values() if "dirpath" in v]
    assert scores and all(score.device.type == "cpu" for score in scores)
    record = TrainCheckpointRecord.from_checkpoint(last_checkpoint(bert_run), last)
    assert record == TrainCheckpointRecord.read(last_checkpoint(bert_run))
    assert record.cursor == record.batch_count == bert_run.plan.batch_count
    assert record.global_step == bert_run.plan.max_steps and not record.early_stopped
    assert record.state_digest == bert_run.result.state_digest
    assert record.session_checkpoint.is_dir()
    assert record.session_checkpoint.parent == record.path.parent
    assert record.seed == 0 and record.output_dir == str(bert_run.output.resolve())
    assert record.settings == settings_of(bert_run)
    assert record.plan_fingerprint == bert_run.plan.fingerprint
    assert json.loads(json.dumps(record.to_dict())) == record.to_dict()


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


def test_create_trainer_follows_the_config_on_one_device(tmp_path, bert_classifier_config):
    hardware = detect_hardware()
    cfg = bert_classifier_config(eval_strategy="epoch", metric_for_best="eval_accuracy")
    trainer, checkpoint, stopping = create_trainer(cfg, hardware, tmp_path / "checkpoints")
    assert trainer.num_devices == 1 and trainer.precision == hardware.precision
    assert isinstance(checkpoint, OutcomeCheckpoint) and checkpoint in trainer.callbacks
    assert checkpoint.monitor == "eval_accuracy" and checkpoint.mode == "max"
    assert checkpoint.dirpath == str(tmp_path / "checkpoints")
    assert stopping is None and not any(isinstance(c, EarlyStopping) for c in trainer.callbacks)
    assert isinstance(trainer.logger, CSVLogger) and trainer.logger.save_dir == str(tmp_path)

    stopping_cfg = bert_classifier_config(
        eval_strategy="epoch", early_stopping=True, early_stopping_patience=3
    )
    trainer, _, stopping = create_trainer(stopping_cfg, hardware, tmp_path / "c", callbacks=[])
    assert stopping in trainer.callbacks
    assert stopping.patience == 3 and stopping.monitor == "eval_loss"
    _, last_only, _ = create_trainer(bert_classifier_config(), hardware, tmp_path / "n")
    assert last_only.monitor is None and last_only.save_top_k == 0
    with pytest.raises(ValueError, match="logger must be one of csv, tensorboard"):
        create_trainer(cfg, hardware, tmp_path, logger_kind="wandb")
    with pytest.raises(ValueError, match="bf16 needs a CUDA device"):
        create_trainer(cfg.replace(precision="bf16"), HardwareInfo("cpu", "32-true", 1), tmp_path)


def test_save_training_summary_writes_json_and_yaml_with_the_final_digest(
    tmp_path, bert_classifier_config
):
    result = TrainingResult(best_score=0.5, best_step=3, state_digest="sha256:" + "0" * 64)
    config = bert_classifier_config()
    hardware = HardwareInfo("cpu", "32-true", 1, device_name="cpu")
    written = save_training_summary(result, config, hardware, tmp_path, extra={"runner": "test"})
    assert written == {
        "json": str(tmp_path / "training_summary.json"),
        "yaml": str(tmp_path / "training_summary.yaml"),
    }
    summary = json.loads(Path(written["json"]).read_text())
    assert yaml.safe_load(Path(written["yaml"]).read_text()) == summary
    assert summary["state_digest"] == result.state_digest and summary["runner"] == "test"
    assert summary["result"] == result.to_dict() and summary["config"] == config.to_dict()
    assert summary["hardware"] == hardware.to_dict()
    only_yaml = save_training_summary(result, config, None, tmp_path / "y", format="yaml")
    assert list(only_yaml) == ["yaml"]
    assert yaml.safe_load(Path(only_yaml["yaml"]).read_text())["hardware"] is None
    with pytest.raises(ValueError, match="summary format must be one of json, yaml, both"):
        save_training_summary(result, config, None, tmp_path, format="xml")


def test_the_controller_and_trainwire_train_write_one_summary_schema(tmp_path, bert_run):
    from trainwire.contract.report.artifacts import run_summary, write_run_artifacts

    result = bert_run.result
    paths = write_run_artifacts(tmp_path, result, bert_run.plan, run_id="r")
    remote = json.loads(paths["json"].read_text())
    local = json.loads((bert_run.output / "training_summary.json").read_text())
    schema = [
        "format",
        "state_digest",
        "config_fingerprint",
        "manifest_fingerprint",
        "batch_count",
        "max_steps",
        "hardware",
        "config",
        "result",
    ]
    assert [k for k in remote if k in schema] == [k for k in local if k in schema] == schema
    assert set(remote) - set(schema) == {"run_id"}
    assert remote["state_digest"] == local["state_digest"] == result.state_digest
    assert remote["hardware"] is None and local["hardware"]["accelerator"] == "cpu"
    assert list(run_summary(result, bert_run.plan.config))[:3] == [
        "format",
        "state_digest",
        "config_fingerprint",
    ]
