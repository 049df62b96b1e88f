"""trainwire.server.training keeps the seed's API: each utility's signature against the seed's,
the dataclasses' fields, the return shapes, the guards over ``read_checkpoint``'s dict of real
``trainwire train`` checkpoints, and the seed's own usage examples, run unchanged."""

import dataclasses
import inspect
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from training_runs import (
    classifier_plan,
    last_checkpoint,
    lora_plan,
    references,
    shared_run,
    stopping_plan,
)

import trainwire.server.training as training
from trainwire.server.training import (
    CheckpointInfo,
    HardwareInfo,
    TrainCheckpointRecord,
    TrainingResult,
    read_checkpoint,
    refuse_a_fresh_start_into_a_used_directory,
    refuse_a_resume_from_another_directory,
    refuse_a_resume_of_a_stopped_run,
    refuse_a_resume_under_other_settings,
    refuse_other_constructor_settings,
    run_settings,
)


class Seed:
    """The seed's signatures, as its API reference gives them (bodies are not the point)."""

    def detect_hardware(log_info=False, *, cuda_precision="bf16-mixed"): ...
    def get_gpu_memory_info(): ...
    def parse_config_overrides(overrides): ...
    def effective_precision(cfg, accelerator): ...
    def run_settings(cfg, *, accelerator, precision): ...
    def constructor_settings(cfg): ...
    def resolve_checkpoint(ckpt_path, checkpoint_dir, experiment_name): ...
    def read_checkpoint(path): ...
    def refuse_a_fresh_start_into_a_used_directory(checkpoint_dir): ...
    def refuse_a_resume_from_another_directory(
        checkpoint, checkpoint_dir, *, resolved_dirpath=None
    ): ...
    def refuse_a_resume_under_other_settings(checkpoint, settings, *, seed): ...
    def refuse_a_resume_of_a_stopped_run(checkpoint, patience): ...
    def refuse_other_constructor_settings(checkpoint, cfg): ...
    def outcome_checkpoint(checkpoint_dir): ...
    def outcome_early_stopping(patience): ...
    def create_trainer(cfg, hardware, checkpoint_dir, callbacks=None, tb_logger=None): ...
    def save_training_summary(result, config, hardware, output_dir, format="both"): ...


SEED_FUNCTIONS = [name for name in vars(Seed) if not name.startswith("_")]
SEED_FIELDS = {
    HardwareInfo: ["accelerator", "precision", "num_devices", "gpu_memory"],
    CheckpointInfo: ["path", "is_same_stage", "exists"],
    TrainingResult: [
        "best_checkpoint_path",
        "last_checkpoint_path",
        "config_path",
        "best_score",
        "stopped_epoch",
        "early_stopped",
        "metrics",
    ],
}


def shape(parameter):
    return (parameter.name, parameter.kind, parameter.default)


@pytest.mark.parametrize("name", SEED_FUNCTIONS)
def test_each_utility_takes_the_seeds_parameters_and_only_keyword_options_beyond(name):
    seed = list(inspect.signature(getattr(Seed, name)).parameters.values())
    ours = list(inspect.signature(getattr(training, name)).parameters.values())
    assert name in training.__all__
    # The seed's parameters first, with its names, kinds (keyword-only markers) and defaults.
    positional = [p for p in seed if p.kind is not p.KEYWORD_ONLY]
    assert [shape(p) for p in ours[: len(positional)]] == [shape(p) for p in positional]
    keyword = {p.name: shape(p) for p in ours if p.kind is p.KEYWORD_ONLY}
    for p in seed[len(positional) :]:
        assert keyword.pop(p.name, None) == shape(p)
    # Anything more is an option: keyword-only, with a default.
    extra = [p for p in ours[len(positional) :] if p.name in keyword]
    assert len(extra) == len(ours) - len(seed)
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in extra)


@pytest.mark.parametrize("cls", list(SEED_FIELDS), ids=lambda c: c.__name__)
def test_each_dataclass_has_the_seeds_fields_first_and_defaults_beyond(cls):
    fields = dataclasses.fields(cls)
    seed = SEED_FIELDS[cls]
    assert [f.name for f in fields[: len(seed)]] == seed
    missing = dataclasses.MISSING
    beyond = fields[len(seed) :]
    assert all(f.default is not missing or f.default_factory is not missing for f in beyond)


def test_the_utilities_return_the_seeds_shapes(tmp_path, bert_classifier_config):
    hardware = training.detect_hardware()
    assert isinstance(hardware, HardwareInfo)
    assert training.parse_config_overrides(None) == ({}, [])
    assert isinstance(training.resolve_checkpoint(None, tmp_path, "x"), CheckpointInfo)
    cfg = bert_classifier_config(eval_strategy="epoch", early_stopping=True)
    trainer, checkpoint, stopping = training.create_trainer(cfg, hardware, tmp_path / "c")
    assert isinstance(trainer, pl.Trainer)
    assert isinstance(checkpoint, ModelCheckpoint) and isinstance(stopping, EarlyStopping)
    paths = training.save_training_summary(TrainingResult(), cfg, hardware, tmp_path)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in paths.items())


# -- the guards, over read_checkpoint's dict of real trainwire train runs -------------------


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, bert_classifier_config):
    return shared_run(tmp_path_factory, classifier_plan(bert_classifier_config))


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, bert_classifier_config):
    return shared_run(tmp_path_factory, stopping_plan(bert_classifier_config))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, llama_config, small_lora):
    return shared_run(tmp_path_factory, lora_plan(llama_config, small_lora))


def checkpoint_of(run):
    return read_checkpoint(last_checkpoint(run))


def settings_of(cfg):
    return run_settings(cfg, accelerator="cpu", precision="32-true")


def patience_of(cfg):
    return cfg.early_stopping_patience if cfg.early_stopping else None


def refused(guard, *args, **kwargs):
    with pytest.raises(ValueError) as error:
        guard(*args, **kwargs)
    return str(error.value)


@pytest.mark.parametrize("which", ["bert", "lora"])
def test_every_guard_passes_the_unchanged_run(which, bert_run, lora_run):
    run = {"bert": bert_run, "lora": lora_run}[which]
    checkpoint, cfg = checkpoint_of(run), run.plan.config
    refuse_a_resume_from_another_directory(checkpoint, run.output / "checkpoints")
    refuse_a_resume_under_other_settings(
        checkpoint, settings_of(cfg), seed=cfg.seed, manifest_fingerprint=run.plan.fingerprint
    )
    refuse_a_resume_of_a_stopped_run(checkpoint, patience_of(cfg))
    refuse_other_constructor_settings(checkpoint, cfg)


def test_a_resume_under_each_other_setting_is_refused_naming_it(bert_run):
    checkpoint, cfg = checkpoint_of(bert_run), bert_run.plan.config
    saved = settings_of(cfg)
    for key, value in saved.items():
        other = "changed" if value != "changed" else "other"
        message = refused(
            refuse_a_resume_under_other_settings, checkpoint, {**saved, key: other}, seed=0
        )
        assert f"cannot resume under other settings: {key}: saved {value!r}, now 'changed'" in (
            message
        )


def test_a_resume_under_other_settings_the_seed_and_the_plan_names_every_difference(bert_run):
    checkpoint, cfg = checkpoint_of(bert_run), bert_run.plan.config
    now = run_settings(
        cfg.replace(gradient_accumulation_steps=1, max_grad_norm=None, num_epochs=3),
        accelerator="cuda",
        precision="bf16-true",
    )
    message = refused(
        refuse_a_resume_under_other_settings,
        checkpoint,
        now,
        seed=7,
        manifest_fingerprint="sha256:" + "1" * 64,
    )
    for difference in (
        "accelerator: saved 'cpu', now 'cuda'",
        "precision: saved '32-true', now 'bf16-true'",
        "gradient_accumulation_steps: saved 2, now 1",
        "max_grad_norm: saved 1.0, now None",
        "num_epochs: saved 2, now 3",
        "seed: saved 0, now 7",
        f"manifest_fingerprint: saved '{bert_run.plan.fingerprint}', now 'sha256:1111",
    ):
        assert difference in message
    assert "Resume with the settings it was saved with" in message
    record = {k: v for k, v in checkpoint["trainwire"].items() if k != "settings"}
    guard = refuse_a_resume_under_other_settings
    assert "records no run settings" in refused(guard, {"trainwire": record}, now, seed=0)
    assert "not one that `trainwire train` wrote" in refused(guard, {}, now, seed=0)


def test_a_resume_from_another_directory_is_refused_and_a_symlink_passes(bert_run, tmp_path):
    checkpoint = checkpoint_of(bert_run)
    saved = os.path.realpath(bert_run.output / "checkpoints")
    message = refused(refuse_a_resume_from_another_directory, checkpoint, tmp_path / "other")
    assert f"belongs to the run in {saved}, not to {tmp_path / 'other'}" in message
    assert f"--output {Path(saved).parent}" in message
    link = tmp_path / "link"
    link.symlink_to(bert_run.output, target_is_directory=True)
    refuse_a_resume_from_another_directory(checkpoint, link / "checkpoints")
    # A resolved directory is compared literally, never resolved again on this host.
    refuse_a_resume_from_another_directory(checkpoint, tmp_path, resolved_dirpath=saved)
    refused(refuse_a_resume_from_another_directory, checkpoint, saved, resolved_dirpath=str(link))
    without = {k: v for k, v in checkpoint.items() if k != "callbacks"}
    message = refused(refuse_a_resume_from_another_directory, without, saved)
    assert "holds no state of this run's ModelCheckpoint" in message


def test_a_fresh_start_into_a_used_directory_or_a_file_is_refused(bert_run, tmp_path):
    message = refused(refuse_a_fresh_start_into_a_used_directory, bert_run.output / "checkpoints")
    assert "already holds a run's checkpoints (best-" in message and "last.ckpt" in message
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("x")
    message = refused(refuse_a_fresh_start_into_a_used_directory, tmp_path / "used")
    assert "already holds other files (notes.txt)" in message
    message = refused(refuse_a_fresh_start_into_a_used_directory, tmp_path / "used" / "notes.txt")
    assert "is not a directory" in message
    (tmp_path / "empty").mkdir()
    refuse_a_fresh_start_into_a_used_directory(tmp_path / "empty")
    refuse_a_fresh_start_into_a_used_directory(tmp_path / "new")


def test_a_resume_of_a_stopped_run_is_refused_naming_where_it_stopped(stopped_run, bert_run):
    checkpoint = checkpoint_of(stopped_run)
    assert stopped_run.result.early_stopped
    message = refused(refuse_a_resume_of_a_stopped_run, checkpoint, 1)
    assert "early stopping ended that run at update 4 after 1 evaluation(s) without gain" in message
    assert "EarlyStopping's stopped_epoch 1" in message and "new --output directory" in message
    message = refused(refuse_a_resume_of_a_stopped_run, checkpoint, 2)
    assert "no state of this run's EarlyStopping (patience 2); it holds one with patience 1" in (
        message
    )
    # A run without early stopping holds no EarlyStopping state: expected only with a patience.
    refuse_a_resume_of_a_stopped_run(checkpoint_of(bert_run), None)
    message = refused(refuse_a_resume_of_a_stopped_run, checkpoint_of(bert_run), 1)
    assert "holds no state of this run's EarlyStopping (patience 1)" in message


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        ({"r": 8}, "lora.r: saved 4, now 8"),
        ({"alpha": 16}, "lora.alpha: saved 8, now 16"),
        ({"dropout": 0.0}, "lora.dropout: saved 0.1, now 0.0"),
        ({"target_modules": ("q_proj",)}, "lora.target_modules: saved ['all-linear'], now"),
        ({"use_dora": True}, "lora.use_dora: saved False, now True"),
    ],
)
def test_a_resume_under_other_lora_settings_is_refused_naming_them(lora_run, change, difference):
    cfg = lora_run.plan.config
    other = cfg.replace(lora=dataclasses.replace(cfg.lora, **change))
    message = refused(refuse_other_constructor_settings, checkpoint_of(lora_run), other)
    assert message.startswith("the checkpoint was trained in another model: " + difference)


def test_a_resume_under_other_lora_target_parameters_is_refused_naming_them(lora_run):
    cfg = lora_run.plan.config
    experts = dataclasses.replace(cfg.lora, dropout=0.0, target_parameters=("down_proj",))
    message = refused(
        refuse_other_constructor_settings, checkpoint_of(lora_run), cfg.replace(lora=experts)
    )
    assert "lora.target_parameters: saved absent, now ['down_proj']" in message


def test_a_resume_into_another_model_names_every_difference(lora_run, bert_run):
    full = lora_run.plan.config.replace(lora=None)
    message = refused(refuse_other_constructor_settings, checkpoint_of(lora_run), full, what="x")
    assert message.startswith("x was trained in another model: lora: saved True, now False")
    assert "lora.r: saved 4, now absent" in message and "lora.use_dora: saved False" in message
    bert = bert_run.plan.config
    message = refused(
        refuse_other_constructor_settings, checkpoint_of(bert_run), bert.replace(labels=("a", "b"))
    )
    assert "labels: saved ['negative', 'positive'], now ['a', 'b']" in message


# -- "done when": the seed's usage examples, unchanged but for the config they pass ---------


def test_the_seeds_usage_examples_run_unchanged(tmp_path, monkeypatch, bert_classifier_config):
    from trainwire.server.engine.session import TrainingSession
    from trainwire.server.training import ManifestModule

    monkeypatch.chdir(tmp_path)
    plan = classifier_plan(bert_classifier_config)
    cfg = plan.config  # the adaptation: this project's config, and the module that trains it

    # The module's Usage section.
    from trainwire.server.training import (
        detect_hardware,
        parse_config_overrides,
        resolve_checkpoint,
    )

    hardware = detect_hardware(log_info=True, cuda_precision="bf16-mixed")
    overrides, invalid = parse_config_overrides(
        [
            "training.learning_rate=1e-4",
            "data_loader.queries_per_step=128",
        ]
    )
    checkpoint_info = resolve_checkpoint("last", Path("checkpoints"), "reference")
    assert overrides == {"training.learning_rate": 1e-4, "data_loader.queries_per_step": 128}
    assert invalid == [] and not checkpoint_info.exists
    assert hardware.precision == ("bf16-mixed" if hardware.accelerator == "cuda" else "32-true")

    # The functions' examples.
    hw = detect_hardware(log_info=True, cuda_precision="bf16-mixed")
    print(f"Training on {hw.accelerator} with {hw.precision} precision")

    from trainwire.server.training import get_gpu_memory_info

    info = get_gpu_memory_info()
    if info:
        print(f"GPU Memory: {info['free_gb']:.1f} GB free")

    overrides = ["training.learning_rate=1e-4", "invalid", "batch_size=32"]
    valid, invalid = parse_config_overrides(overrides)
    assert valid == {"training.learning_rate": 0.0001, "batch_size": 32}
    assert invalid == ["invalid"]

    info = resolve_checkpoint("last", Path("checkpoints"), "01_text")
    if info.exists:
        print(f"Resuming from {info.path}")

    from trainwire.server.training import create_trainer, save_training_summary

    model = ManifestModule(plan, TrainingSession(cfg, device="cpu", max_steps=plan.max_steps))
    datamodule = None  # the module brings its own data: the plan's microbatches
    hw = detect_hardware()
    trainer, ckpt_cb, es_cb = create_trainer(cfg, hw, Path("checkpoints"))
    trainer.fit(model, datamodule)

    result = model.result(last_checkpoint_path=ckpt_cb.last_model_path)
    paths = save_training_summary(result, cfg, hw, Path("outputs"))
    print(f"Summary saved to: {paths}")

    assert es_cb is None  # this plan does not stop early (with early stopping: the callback)
    # And it trained for real: the plan's bits, a resumable last.ckpt, the summary on disk.
    assert result.state_digest == references(plan)[0]
    last = resolve_checkpoint("last", Path("."), "checkpoints")
    assert last.exists and TrainCheckpointRecord.read(last.path).session_checkpoint.is_dir()
    assert Path(paths["json"]).is_file() and Path(paths["yaml"]).is_file()
