"""TrainingConfig: validation, JSON round trip and the fingerprint."""

import json
import re

import pytest

from trainwire.client import InputExample, LoraSettings, TrainingConfig


def classification_config(**changes):
    base = TrainingConfig(
        model="tiny-bert", task="sequence-classification", labels=("negative", "positive")
    )
    return base.replace(**changes)


def test_round_trip_through_json_gives_an_equal_config_and_fingerprint():
    config = classification_config(lora=LoraSettings(r=4, target_modules=("query", "value")))
    again = TrainingConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert again.fingerprint() == config.fingerprint()


def test_fingerprint_is_sha256_of_the_canonical_json():
    import hashlib

    config = TrainingConfig(model="m")
    canonical = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert config.fingerprint() == "sha256:" + hashlib.sha256(canonical).hexdigest()
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", config.fingerprint())


@pytest.mark.parametrize(
    "change",
    [
        {"learning_rate": 1e-4},
        {"seed": 1},
        {"lora": LoraSettings()},
        {"batch_size": 4},
        {"truncation": True},
    ],
)
def test_any_setting_changes_the_fingerprint(change):
    config = TrainingConfig(model="m")
    assert config.replace(**change).fingerprint() != config.fingerprint()


def test_from_dict_refuses_unknown_keys_by_name():
    data = TrainingConfig(model="m").to_dict() | {"learnin_rate": 1.0}
    with pytest.raises(ValueError, match="learnin_rate"):
        TrainingConfig.from_dict(data)


def test_from_dict_refuses_unknown_lora_keys_by_name():
    data = TrainingConfig(model="m", lora=LoraSettings()).to_dict()
    data["lora"]["rank"] = 4
    with pytest.raises(ValueError, match=r"lora\.rank"):
        TrainingConfig.from_dict(data)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"precision": "fp16"}, "fp16"),
        ({"num_workers": 2}, "num_workers"),
        ({"batch_size": 0}, "batch_size"),
        ({"lr_scheduler": "step"}, "lr_scheduler"),
        ({"task": "translation"}, "task"),
        ({"eval_strategy": "steps"}, "eval_steps"),
        ({"early_stopping": True}, "early_stopping"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"batch_size": True}, "batch_size"),
    ],
)
def test_bad_values_are_refused_naming_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        TrainingConfig(model="m").replace(**change)


def test_all_problems_are_reported_at_once():
    with pytest.raises(ValueError) as caught:
        TrainingConfig(model="m", batch_size=0, num_epochs=0, precision="fp16")
    message = str(caught.value)
    assert "batch_size" in message and "num_epochs" in message and "fp16" in message


def test_classification_needs_two_distinct_labels():
    with pytest.raises(ValueError, match="labels"):
        classification_config(labels=("only",))
    with pytest.raises(ValueError, match="repeat"):
        classification_config(labels=("a", "a"))


def test_accuracy_is_a_classification_metric_and_higher_is_better():
    assert classification_config(metric_for_best="eval_accuracy").selection_mode == "max"
    assert classification_config().selection_mode == "min"
    with pytest.raises(ValueError, match="eval_accuracy"):
        TrainingConfig(model="m", metric_for_best="eval_accuracy")


def test_lora_settings_validate():
    with pytest.raises(ValueError, match=r"lora\.r"):
        LoraSettings(r=0)
    with pytest.raises(ValueError, match=r"lora\.dropout"):
        LoraSettings(dropout=1.0)


def test_input_example_round_trip_and_field_types():
    example = InputExample("prompt", completion="answer")
    assert InputExample.from_dict(example.to_dict()) == example
    assert example.to_dict() == {"text": "prompt", "completion": "answer"}
    with pytest.raises(ValueError, match="text"):
        InputExample.from_dict({"label": "x"})
    with pytest.raises(ValueError, match="unknown"):
        InputExample.from_dict({"text": "x", "labl": "y"})


def test_a_yaml_config_reads_numbers_as_people_write_them(tmp_path) -> None:
    """Issue 24.8: YAML 1.1 reads ``1e-3`` (no dot) as a string; a config reads it as 0.001."""
    from trainwire.contract.planning.manifest import read_config_file

    path = tmp_path / "config.yaml"
    path.write_text("model: m\nlearning_rate: 1e-3\nadam_epsilon: 1E-8\nweight_decay: .5\n")
    data = read_config_file(path)
    assert (data["learning_rate"], data["adam_epsilon"], data["weight_decay"]) == (1e-3, 1e-8, 0.5)
    assert TrainingConfig.from_dict(data).learning_rate == 0.001


def test_a_value_that_is_no_number_is_called_so(tmp_path) -> None:
    from trainwire.contract.planning.manifest import read_config_file

    path = tmp_path / "config.yaml"
    path.write_text("model: m\nlearning_rate: '1e-3'\nadam_beta1: fast\n")
    with pytest.raises(ValueError, match=r"learning_rate: not a number, got '1e-3'") as refused:
        TrainingConfig.from_dict(read_config_file(path))
    assert "adam_beta1: not a number, got 'fast'" in str(refused.value)


def test_lora_target_parameters_round_trip_through_json_and_change_the_fingerprint():
    experts = LoraSettings(
        r=4, dropout=0.0, target_modules=(), target_parameters=["experts.gate_up_proj"]
    )
    assert experts.target_parameters == ("experts.gate_up_proj",)  # a list arrives as a tuple
    config = TrainingConfig(model="m", lora=experts)
    again = TrainingConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.fingerprint() == config.fingerprint()
    assert config.fingerprint() != config.replace(lora=LoraSettings(r=4)).fingerprint()


def test_lora_without_target_parameters_keeps_the_fingerprint_it_always_had():
    # Checkpoints, journals and manifests written before the setting existed still resume.
    assert "target_parameters" not in LoraSettings().to_dict()
    config = TrainingConfig(model="m", lora=LoraSettings(r=4))
    data = config.to_dict()
    assert data["lora"] == {
        "r": 4,
        "alpha": 16,
        "dropout": 0.0,
        "target_modules": ["all-linear"],
        "use_dora": False,
    }
    assert TrainingConfig.from_dict(data).fingerprint() == config.fingerprint()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"target_parameters": ("",)}, r"lora\.target_parameters: must be a list of names"),
        ({"target_parameters": "experts.down_proj"}, r"lora\.target_parameters: must be a list"),
        ({"target_modules": ()}, r"lora\.target_modules: .*it may be empty only with target_param"),
        (
            {"target_parameters": ("down_proj",), "dropout": 0.1},
            r"lora\.dropout: must be 0 with target_parameters",
        ),
        (
            {"target_parameters": ("down_proj",), "use_dora": True},
            r"lora\.use_dora: DoRA does not apply to target_parameters",
        ),
    ],
    ids=["empty-name", "a-string", "no-targets", "dropout", "dora"],
)
def test_lora_target_parameters_are_validated(settings, message):
    with pytest.raises(ValueError, match=message):
        LoraSettings(**settings)
    with pytest.raises(ValueError, match=message):
        TrainingConfig.from_dict({"model": "m", "lora": {**settings}})
