"""Reading and writing the files a plan is made from and written to."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from trainwire.contract.config import InputExample, TrainingConfig
from trainwire.contract.files import write_bytes_atomic
from trainwire.contract.planning.plan import ManagedTrainingPlan, example_problem
from trainwire.contract.planning.token_lengths import TokenCounter


def read_examples_jsonl(path: str | Path) -> list[InputExample]:
    """One JSON example per line (blank lines skipped); a bad line is refused with its number."""
    return [example for _, example in read_numbered_examples(path)]


def read_numbered_examples(path: str | Path) -> list[tuple[int, InputExample]]:
    """``(line number, example)`` of every example in a JSON-lines file, so a later check can
    still name the line it refuses."""
    examples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                examples.append((number, InputExample.from_dict(json.loads(line))))
            except ValueError as error:
                # json.JSONDecodeError is a ValueError too.
                raise ValueError(f"{path}:{number}: {error}") from None
    return examples


def check_numbered_examples(
    path: str | Path,
    examples: list[tuple[int, InputExample]],
    config: TrainingConfig,
    counter: TokenCounter | None,
) -> None:
    """Refuse the first example of ``path`` that cannot train under ``config``, naming its
    line: a label, an empty text, or (with the model's tokenizer at hand) more tokens than
    ``max_length`` while truncation is off."""
    for number, example in examples:
        problem = example_problem(example, config)
        if problem is None and counter is not None and not config.truncation:
            tokens = counter.count(example)
            if tokens > config.max_length:
                problem = (
                    f"{tokens} tokens is over max_length {config.max_length}; shorten it, "
                    "raise max_length, or set truncation true to cut it"
                )
        if problem is not None:
            raise ValueError(f"{path}:{number}: {problem}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config as a dict, from ``.json`` or ``.yaml``/``.yml``; validated by the caller."""
    text = Path(path).read_text(encoding="utf-8")
    suffix = Path(path).suffix.lower()
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.load(text, Loader=_numbers_as_written_loader(yaml))
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not valid YAML: {error}") from None
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{path}: not valid JSON: {error}") from None
    else:
        raise ValueError(f"{path}: a config file must end in .json, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a mapping of keys to values")
    return data


# YAML 1.1 (PyYAML's) reads ``1e-3`` as a string: a float needs a dot there. Configs are written
# by people who write learning rates that way, so floats are read as YAML 1.2 and JSON read them.
_FLOAT_AS_WRITTEN = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


def _numbers_as_written_loader(yaml: Any) -> type:
    """PyYAML's safe loader, reading ``1e-3`` as the float it is (a plain safe loader else)."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", _FLOAT_AS_WRITTEN, list("-+0123456789.")
    )
    return Loader


def write_manifest(path: str | Path, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically: a crash leaves the old file or none, never half of one."""
    write_bytes_atomic(path, json.dumps(manifest, separators=(",", ":")).encode())


def write_plan_manifest(path: str | Path, plan: ManagedTrainingPlan) -> None:
    """Write a plan's manifest atomically, encoding it once (the fast path for large plans)."""
    write_bytes_atomic(path, plan.manifest_bytes())


def read_manifest(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path}: not a JSON manifest: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a manifest must be a JSON object")
    return data


def load_plan(path: str | Path) -> ManagedTrainingPlan:
    """Read and verify a manifest file."""
    return ManagedTrainingPlan.from_manifest(read_manifest(path))
