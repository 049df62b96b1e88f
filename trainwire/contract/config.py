"""The training configuration: typed, frozen, validated at construction, JSON round-trippable.

The config travels inside a manifest and across the wire, and its fingerprint binds checkpoints,
journals and runs to it, so it is a plain value: no paths are resolved and no model is touched
here. Every problem is reported at once, each naming its key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainwire.contract.config_keys import (
    CONFIG_ALIASES,
    LORA_ALIASES,
    describe_config_keys,
    unknown_keys_message,
    with_trainwire_names,
)

TASKS = ("causal-lm", "sequence-classification")
LR_SCHEDULERS = ("linear", "constant", "cosine")
PRECISIONS = ("fp32", "bf16")
EVAL_STRATEGIES = ("no", "epoch", "steps")
METRICS = ("eval_loss", "eval_accuracy")


def canonical_json(value: Any) -> bytes:
    """The one canonical encoding every fingerprint hashes: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


ABSENT = "absent"


def setting_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: saved X, now Y`` for each differing key, in ``saved``'s order then ``now``'s.

    A key one side lacks reads ``absent`` there. Every refusal to resume names what differs
    with this one wording.
    """
    keys = list(saved) + [key for key in now if key not in saved]
    out = []
    for key in keys:
        if (key in saved) != (key in now) or saved.get(key) != now.get(key):
            before = repr(saved[key]) if key in saved else ABSENT
            after = repr(now[key]) if key in now else ABSENT
            out.append(f"{key}: saved {before}, now {after}")
    return out


def sha256_fingerprint(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class InputExample:
    """One training or evaluation example.

    causal-lm: the model learns ``text``; with ``completion`` it learns the completion after the
    prompt ``text`` (the prompt is masked out of the loss). sequence-classification: ``label`` is
    one of the config's labels.
    """

    text: str
    label: str | None = None
    completion: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ValueError(f"text must be a string, got {type(self.text).__name__}")
        for name in ("label", "completion"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or null, got {type(value).__name__}")

    def to_dict(self) -> dict[str, str]:
        """Only the fields that are set, so manifests stay small and canonical."""
        out = {"text": self.text}
        if self.label is not None:
            out["label"] = self.label
        if self.completion is not None:
            out["completion"] = self.completion
        return out

    @classmethod
    def from_dict(cls, data: Any) -> InputExample:
        if not isinstance(data, dict):
            raise ValueError(f"an example must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"text", "label", "completion"})
        if unknown:
            raise ValueError(f"unknown example field(s): {', '.join(unknown)}")
        if "text" not in data:
            raise ValueError("an example needs the field 'text'")
        return cls(text=data["text"], label=data.get("label"), completion=data.get("completion"))


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """One trainable LoRA adapter (PEFT). ``target_modules=("all-linear",)`` targets every linear
    layer but the output head, as PEFT defines it.

    ``target_parameters`` reaches weights that are parameters rather than ``nn.Linear`` layers,
    such as a mixture of experts' fused ``experts.gate_up_proj`` (PEFT's names: a parameter's
    name or a suffix of it); ``target_modules`` may then be empty. PEFT cannot factor dropout
    or DoRA out of such an adapter, so both are refused with it.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    use_dora: bool = False
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Lists arrive from JSON; a tuple keeps the value hashable and frozen.
        for name in ("target_modules", "target_parameters"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = _lora_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "r": self.r,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(self.target_modules),
            "use_dora": self.use_dora,
        }
        # Only when set: every config written before the field existed keeps its fingerprint,
        # so its checkpoints, journals and manifests still resume.
        if self.target_parameters:
            out["target_parameters"] = list(self.target_parameters)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> LoraSettings:
        if not isinstance(data, dict):
            raise ValueError(f"lora: must be an object or null, got {type(data).__name__}")
        data = with_trainwire_names(data, LORA_ALIASES, prefix="lora.")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(
                unknown_keys_message(unknown, known, LORA_ALIASES, what="lora", prefix="lora.")
            )
        return cls(**data)


def is_int(value: Any) -> bool:
    """An int and not a bool: ``True`` is an ``int`` to Python, but never a count or a seed."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _lora_problems(lora: LoraSettings) -> list[str]:
    problems = []
    if not is_int(lora.r) or lora.r < 1:
        problems.append(f"lora.r: must be a positive integer, got {lora.r!r}")
    if not _is_number(lora.alpha) or lora.alpha <= 0:
        problems.append(f"lora.alpha: must be a positive number, got {lora.alpha!r}")
    if not _is_number(lora.dropout) or not 0.0 <= lora.dropout < 1.0:
        problems.append(f"lora.dropout: must be in [0, 1), got {lora.dropout!r}")
    targets, parameters = lora.target_modules, lora.target_parameters
    parameters_ok = _is_name_list(parameters)
    if not parameters_ok:
        problems.append(f"lora.target_parameters: must be a list of names, got {parameters!r}")
    if not _is_name_list(targets) or not (targets or (parameters_ok and parameters)):
        problems.append(
            "lora.target_modules: must be a non-empty list of names (it may be empty only "
            f"with target_parameters), got {targets!r}"
        )
    if not isinstance(lora.use_dora, bool):
        problems.append(f"lora.use_dora: must be true or false, got {lora.use_dora!r}")
    if parameters_ok and parameters:
        if _is_number(lora.dropout) and lora.dropout != 0:
            problems.append(
                f"lora.dropout: must be 0 with target_parameters (PEFT cannot apply dropout to "
                f"an adapter on a parameter), got {lora.dropout!r}"
            )
        if lora.use_dora is True:
            problems.append("lora.use_dora: DoRA does not apply to target_parameters; set false")
    return problems


def _is_name_list(value: Any) -> bool:
    """A tuple of non-empty strings (empty allowed: each caller says when it may be)."""
    return isinstance(value, tuple) and all(isinstance(t, str) and t for t in value)


# Hugging Face TrainingArguments' switch for graph compilation. A compiled graph runs other
# kernels (fused, reordered) than eager mode on the same inputs, so its bits differ from the run
# the journal, the checkpoints and the sampler's logprobs promise: asking for it is refused.
COMPILE_KEY = "torch_compile"


def _without_refused_compilation(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without ``torch_compile: false`` (what every config is); ValueError naming the
    reason for any other value."""
    if COMPILE_KEY not in data:
        return data
    if data[COMPILE_KEY] is not False:
        raise ValueError(
            f"{COMPILE_KEY}: graph compilation is refused: compiled kernels give other bits than "
            "eager ones, and trainwire promises the same bits in-process, remote and resumed; "
            f"leave {COMPILE_KEY} out (or false)"
        )
    return {key: value for key, value in data.items() if key != COMPILE_KEY}


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    """Everything that decides a run's bits. Names follow Hugging Face ``TrainingArguments``.

    Attributes:
        model: a local model directory, resolved where the session runs (under its model root).
        task: ``causal-lm`` or ``sequence-classification``.
        labels: the class names of a classification task, in label-id order.
        lora: one LoRA adapter, or None to train the full weights.
        learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon: AdamW (decoupled
            weight decay; biases and norms never decay).
        lr_scheduler: ``linear``, ``constant`` or ``cosine``, after ``warmup_steps`` of
            linear warmup.
        max_grad_norm: clip the global gradient norm to this; None disables clipping.
        batch_size: examples per microbatch.
        gradient_accumulation_steps: microbatches per optimizer update.
        num_epochs: passes over the training examples.
        max_length: the longest example in tokens; longer ones are refused unless ``truncation``.
            The default, 256, is what the smallest models hold (the project's own tiny ones
            have 256 positions), so a config that leaves it out runs on any model; a session
            refuses a ``max_length`` past its model's positions.
        shuffle, group_by_length: the plan's order (seeded, identical on every machine).
        seed: seeds the plan's order and the session's RNG.
        precision: ``fp32``, or ``bf16`` on a CUDA device with native bf16 support.
        gradient_checkpointing: trade compute for memory (non-reentrant).
        eval_strategy, eval_steps: evaluate at every epoch end, or every ``eval_steps`` updates.
        metric_for_best, greater_is_better: the selection metric; None for greater_is_better means
            "as the metric implies" (loss: lower is better, accuracy: higher is better).
        early_stopping, early_stopping_patience: stop after this many evaluations without gain
            (an equal metric is no gain).
        truncation: cut over-long examples to ``max_length`` instead of refusing them.
        num_workers: must be 0; data is tokenized in the session's own thread.
    """

    model: str
    task: str = "causal-lm"
    labels: tuple[str, ...] = ()
    lora: LoraSettings | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler: str = "linear"
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_epochs: int = 1
    max_length: int = 256
    shuffle: bool = True
    group_by_length: bool = False
    seed: int = 0
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    eval_strategy: str = "no"
    eval_steps: int | None = None
    metric_for_best: str = "eval_loss"
    greater_is_better: bool | None = None
    early_stopping: bool = False
    early_stopping_patience: int = 1
    truncation: bool = False
    num_workers: int = 0
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.labels, list):
            object.__setattr__(self, "labels", tuple(self.labels))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraSettings.from_dict(self.lora))
        problems = _config_problems(self)
        if problems:
            raise ValueError("invalid training config: " + "; ".join(problems))
        object.__setattr__(self, "_fingerprint", sha256_fingerprint(canonical_json(self.to_dict())))

    @property
    def selection_mode(self) -> str:
        """``max`` or ``min``: the direction in which ``metric_for_best`` improves."""
        if self.greater_is_better is not None:
            return "max" if self.greater_is_better else "min"
        return "max" if self.metric_for_best == "eval_accuracy" else "min"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name.startswith("_"):
                continue
            value = getattr(self, f.name)
            if f.name == "labels":
                value = list(value)
            elif f.name == "lora":
                value = None if value is None else value.to_dict()
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> TrainingConfig:
        """Build a config from JSON-like data; unknown keys and bad values raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ValueError(f"a training config must be an object, got {type(data).__name__}")
        data = with_trainwire_names(_without_refused_compilation(data), CONFIG_ALIASES)
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(unknown_keys_message(unknown, known, CONFIG_ALIASES, what="config"))
        if "model" not in data:
            raise ValueError("model: missing (a local model directory)")
        values = dict(data)
        if values.get("lora") is not None:
            values["lora"] = LoraSettings.from_dict(values["lora"])
        return cls(**values)

    @classmethod
    def describe_keys(cls) -> str:
        """Every key with its default and meaning, as a YAML file to start from."""
        defaults = {
            f.name: None if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(cls)
            if f.init
        }
        defaults["labels"] = list(defaults["labels"])
        return describe_config_keys(defaults, LoraSettings().to_dict())

    def replace(self, **changes: Any) -> TrainingConfig:
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> str:
        """``sha256:<64 hex>`` of the canonical JSON of ``to_dict()``."""
        return self._fingerprint


def _config_problems(c: TrainingConfig) -> list[str]:
    problems: list[str] = []

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            problems.append(f"{key}: {what}, got {getattr(c, key)!r}")

    need(isinstance(c.model, str) and bool(c.model), "model", "must be a model directory")
    need(c.task in TASKS, "task", f"must be one of {', '.join(TASKS)}")
    labels_ok = isinstance(c.labels, tuple) and all(isinstance(x, str) and x for x in c.labels)
    need(labels_ok, "labels", "must be a list of non-empty strings")
    if labels_ok:
        need(len(set(c.labels)) == len(c.labels), "labels", "must not repeat")
        if c.task == "sequence-classification":
            need(len(c.labels) >= 2, "labels", "sequence-classification needs at least two")
        else:
            need(not c.labels, "labels", "only sequence-classification takes labels")

    def number(key: str, fits: Callable[[float], bool], what: str) -> None:
        """A finite number in range: "not a number" for a string (quoted in YAML, say)."""
        value = getattr(c, key)
        if not _is_number(value):
            problems.append(f"{key}: not a number, got {value!r}")
        elif not fits(value):
            problems.append(f"{key}: {what}, got {value!r}")

    need(c.lora is None or isinstance(c.lora, LoraSettings), "lora", "must be LoRA settings")
    number("learning_rate", lambda v: v >= 0, "must be >= 0")
    number("weight_decay", lambda v: v >= 0, "must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        number(key, lambda v: 0 <= v < 1, "must be in [0, 1)")
    number("adam_epsilon", lambda v: v > 0, "must be > 0")
    need(c.lr_scheduler in LR_SCHEDULERS, "lr_scheduler", f"must be one of {LR_SCHEDULERS}")
    need(is_int(c.warmup_steps) and c.warmup_steps >= 0, "warmup_steps", "must be an int >= 0")
    if c.max_grad_norm is not None:
        number("max_grad_norm", lambda v: v > 0, "must be > 0 or null (no clipping)")
    for key in ("batch_size", "gradient_accumulation_steps", "num_epochs", "max_length"):
        value = getattr(c, key)
        need(is_int(value) and value >= 1, key, "must be a positive integer")
    for key in ("shuffle", "group_by_length", "gradient_checkpointing", "early_stopping"):
        need(isinstance(getattr(c, key), bool), key, "must be true or false")
    need(isinstance(c.truncation, bool), "truncation", "must be true or false")
    need(is_int(c.seed) and 0 <= c.seed < 2**63, "seed", "must be an integer in [0, 2**63)")
    if c.precision == "fp16":
        problems.append(
            "precision: fp16 is not supported (no loss scaling here); use fp32, or bf16 on a GPU"
        )
    else:
        need(c.precision in PRECISIONS, "precision", f"must be one of {', '.join(PRECISIONS)}")
    need(c.eval_strategy in EVAL_STRATEGIES, "eval_strategy", f"must be one of {EVAL_STRATEGIES}")
    if c.eval_strategy == "steps":
        steps_ok = is_int(c.eval_steps) and c.eval_steps >= 1
        need(steps_ok, "eval_steps", "eval_strategy 'steps' needs a positive integer")
    else:
        need(c.eval_steps is None, "eval_steps", "is only used with eval_strategy 'steps'")
    need(c.metric_for_best in METRICS, "metric_for_best", f"must be one of {', '.join(METRICS)}")
    if c.metric_for_best == "eval_accuracy":
        need(
            c.task == "sequence-classification",
            "metric_for_best",
            "eval_accuracy needs task sequence-classification",
        )
    gib_ok = c.greater_is_better is None or isinstance(c.greater_is_better, bool)
    need(gib_ok, "greater_is_better", "must be true, false or null")
    patience_ok = is_int(c.early_stopping_patience) and c.early_stopping_patience >= 1
    need(patience_ok, "early_stopping_patience", "must be a positive integer")
    if c.early_stopping is True:
        need(c.eval_strategy != "no", "early_stopping", "needs an eval_strategy other than 'no'")
    need(
        c.num_workers == 0 and is_int(c.num_workers),
        "num_workers",
        "must be 0 (data is prepared in the session's own thread, so the bits never depend on "
        "worker scheduling)",
    )
    return problems
