"""The config names a user already knows: Hugging Face's for the same settings, the nearest key
to a typo, and every key printed with its default and meaning."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from trainwire.cli import main
from trainwire.client import LoraSettings, TrainingConfig
from trainwire.contract.config_keys import CONFIG_ALIASES, CONFIG_MEANINGS
from trainwire.contract.planning.overrides import config_with_overrides


def test_hugging_face_names_are_trainwires_settings_under_trainwires_names():
    config = TrainingConfig.from_dict(
        {
            "model": "m",
            "num_train_epochs": 3,
            "per_device_train_batch_size": 4,
            "lr_scheduler_type": "cosine",
            "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1},
        }
    )
    same = TrainingConfig(
        model="m",
        num_epochs=3,
        batch_size=4,
        lr_scheduler="cosine",
        lora=LoraSettings(r=4, alpha=8, dropout=0.1),
    )
    assert config == same and config.fingerprint() == same.fingerprint()
    assert "num_train_epochs" not in config.to_dict()


def test_a_name_given_twice_under_both_spellings_is_refused_naming_both():
    with pytest.raises(ValueError, match="num_train_epochs and num_epochs are the same setting"):
        TrainingConfig.from_dict({"model": "m", "num_epochs": 1, "num_train_epochs": 2})


def test_a_set_override_under_the_hugging_face_name_replaces_the_files_setting():
    config = config_with_overrides(
        {"model": "m", "num_epochs": 1, "lora": {"alpha": 16}},
        ["num_train_epochs=5", "lora.lora_alpha=4"],
    )
    assert config.num_epochs == 5 and config.lora.alpha == 4


@pytest.mark.parametrize(
    ("data", "hint"),
    [
        ({"model": "m", "learning_rat": 1e-4}, "learning_rat (did you mean learning_rate?)"),
        ({"model": "m", "num_train_epoch": 2}, "num_train_epoch (did you mean num_epochs?)"),
        ({"model": "m", "lora": {"alpah": 4}}, "lora.alpah (did you mean lora.alpha?)"),
    ],
)
def test_a_typo_is_answered_with_the_nearest_key_and_where_every_key_is_listed(data, hint):
    with pytest.raises(ValueError) as refused:
        TrainingConfig.from_dict(data)
    assert hint in str(refused.value)
    assert "trainwire plan --print-config" in str(refused.value)


def test_every_key_has_its_meaning_and_every_alias_names_a_key():
    keys = [f.name for f in dataclasses.fields(TrainingConfig) if f.init]
    assert list(CONFIG_MEANINGS) == keys
    assert set(CONFIG_ALIASES.values()) <= set(keys)


def test_print_config_is_a_config_file_of_every_default(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "trainwire", "plan", "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed.pop("model") is None  # the one key without a default: the user's to set
    assert TrainingConfig.from_dict({"model": "m", **printed}) == TrainingConfig(model="m")
    for key, meaning in CONFIG_MEANINGS.items():
        assert f"# {meaning}" in done.stdout, key


def test_version_prints_the_packages_version(capsys):
    from trainwire import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"trainwire {__version__}"
