"""The training plan: which rows form each microbatch, where updates, epochs and evaluations fall.

The plan is computed once, on any machine, without torch: a seeded ``random.Random`` per epoch
orders the rows, so the same examples and config give the same plan on every machine, Python
version and process. Its manifest is content-addressed: the fingerprint covers every example,
setting and boundary, and every server-side operation key embeds it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trainwire.contract.config import (
    InputExample,
    TrainingConfig,
    canonical_json,
    sha256_fingerprint,
)

MANIFEST_FORMAT = "trainwire.manifest/v1"

# Length grouping sorts within windows of this many batches (the "megabatch" of Hugging Face's
# LengthGroupedSampler), so batches hold similar lengths while the order stays random.
GROUPING_WINDOW_BATCHES = 50


@dataclass(frozen=True, slots=True)
class Microbatch:
    """One microbatch of the plan: its rows and the boundaries that follow it."""

    rows: tuple[int, ...]
    epoch: int
    update: bool
    epoch_end: bool
    evaluate: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": list(self.rows),
            "epoch": self.epoch,
            "update": self.update,
            "epoch_end": self.epoch_end,
            "evaluate": self.evaluate,
        }


def _epoch_rng(seed: int, epoch: int) -> random.Random:
    """An RNG per epoch, derived by hashing, so epochs are independent of each other's draws."""
    digest = hashlib.sha256(f"trainwire/plan/{seed}/{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def example_lengths(examples: Sequence[InputExample]) -> list[int]:
    """The planner's length measure: characters, since the planner has no tokenizer."""
    return [len(example.text) + len(example.completion or "") for example in examples]


def epoch_batches(
    example_count: int, config: TrainingConfig, epoch: int, lengths: Sequence[int] | None = None
) -> list[list[int]]:
    """The row batches of one epoch; every row exactly once, a partial batch last.

    ``lengths`` (one per example) is needed only for ``group_by_length``.
    """
    size = config.batch_size
    order = list(range(example_count))
    rng = _epoch_rng(config.seed, epoch)
    if config.shuffle or config.group_by_length:
        rng.shuffle(order)
    if config.group_by_length:
        if lengths is None:
            raise ValueError("group_by_length needs the examples' lengths")
        window = size * GROUPING_WINDOW_BATCHES
        grouped: list[int] = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            # Longest first within a window; ties keep the shuffled order (the sort is stable,
            # also in reverse).
            chunk.sort(key=lengths.__getitem__, reverse=True)
            grouped.extend(chunk)
        order = grouped
    batches = [order[start : start + size] for start in range(0, len(order), size)]
    if config.group_by_length:
        partial = batches.pop() if len(batches[-1]) < size else None
        rng.shuffle(batches)
        if partial is not None:
            batches.append(partial)
    return batches


def build_schedule(examples: Sequence[InputExample], config: TrainingConfig) -> list[Microbatch]:
    """Every microbatch of the run, with its update, epoch-end and evaluation boundaries."""
    schedule: list[Microbatch] = []
    steps = 0
    accumulation = config.gradient_accumulation_steps
    lengths = example_lengths(examples) if config.group_by_length else None
    for epoch in range(config.num_epochs):
        batches = epoch_batches(len(examples), config, epoch, lengths)
        for j, rows in enumerate(batches):
            epoch_end = j == len(batches) - 1
            update = (j + 1) % accumulation == 0 or epoch_end
            steps += update
            if config.eval_strategy == "epoch":
                evaluate = epoch_end
            elif config.eval_strategy == "steps":
                evaluate = update and steps % config.eval_steps == 0
            else:
                evaluate = False
            schedule.append(Microbatch(tuple(rows), epoch, update, epoch_end, evaluate))
    return schedule


def check_examples(
    examples: Sequence[InputExample], config: TrainingConfig, *, what: str = "example"
) -> None:
    """Refuse examples that cannot train under ``config``, naming the first bad index."""
    for index, example in enumerate(examples):
        problem = example_problem(example, config)
        if problem is not None:
            raise ValueError(f"{what} {index}: {problem}")


def example_problem(example: InputExample, config: TrainingConfig) -> str | None:
    """Why ``example`` cannot train under ``config`` (None: it can). One rule for the plan, the
    files it is read from (which name the line) and the session (which names the index)."""
    if not isinstance(example, InputExample):
        return f"expected an InputExample, got {type(example)!r}"
    if not example.text:
        return "empty text"
    if config.task == "sequence-classification":
        if example.label is None:
            return f"missing label (one of {list(config.labels)})"
        if example.label not in config.labels:
            return f"unknown label {example.label!r}; the config's labels are {list(config.labels)}"
        if example.completion is not None:
            return "classification examples take no completion"
    else:
        if example.label is not None:
            return "causal-lm examples take no label"
        if example.completion == "":
            return "empty completion (omit it to learn the text)"
    return None


class ManagedTrainingPlan:
    """The plan of a managed run over ``examples`` under ``config``.

    Microbatch ``i`` (``0 <= i < batch_count``) holds ``rows(i)``; an optimizer update follows it
    iff ``is_update(i)``; evaluation follows it iff ``evaluates_after(i)``.
    """

    def __init__(
        self,
        examples: Iterable[InputExample],
        config: TrainingConfig,
        *,
        eval_examples: Iterable[InputExample] | None = None,
    ) -> None:
        examples = list(examples)
        eval_examples = None if eval_examples is None else list(eval_examples)
        _check_plan_inputs(examples, config, eval_examples)
        self._init(examples, config, eval_examples, build_schedule(examples, config))

    def _init(
        self,
        examples: list[InputExample],
        config: TrainingConfig,
        eval_examples: list[InputExample] | None,
        schedule: list[Microbatch],
    ) -> None:
        self.examples = examples
        self.config = config
        self.eval_examples = eval_examples
        self._schedule = schedule
        self._steps_after: list[int] = []
        steps = 0
        for microbatch in schedule:
            steps += microbatch.update
            self._steps_after.append(steps)
        self._fingerprint: str | None = None

    # -- the schedule -----------------------------------------------------------------------

    @property
    def batch_count(self) -> int:
        return len(self._schedule)

    @property
    def max_steps(self) -> int:
        """Optimizer updates in the whole run (the schedule's horizon)."""
        return self._steps_after[-1]

    def microbatch(self, i: int) -> Microbatch:
        if not 0 <= i < len(self._schedule):
            raise IndexError(f"microbatch {i} is outside the plan's 0..{len(self._schedule) - 1}")
        return self._schedule[i]

    def rows(self, i: int) -> list[int]:
        return list(self.microbatch(i).rows)

    def batch(self, i: int) -> list[InputExample]:
        return [self.examples[row] for row in self.microbatch(i).rows]

    def epoch(self, i: int) -> int:
        return self.microbatch(i).epoch

    def is_update(self, i: int) -> bool:
        return self.microbatch(i).update

    def is_epoch_end(self, i: int) -> bool:
        return self.microbatch(i).epoch_end

    def evaluates_after(self, i: int) -> bool:
        return self.microbatch(i).evaluate

    def steps_after(self, i: int) -> int:
        """Optimizer updates completed once microbatch ``i`` and its update have run."""
        self.microbatch(i)
        return self._steps_after[i]

    @property
    def selection_policy(self) -> dict[str, Any]:
        """How the best evaluation is chosen and when the run stops early."""
        return {
            "metric": self.config.metric_for_best,
            "mode": self.config.selection_mode,
            "patience": self.config.early_stopping_patience if self.config.early_stopping else None,
        }

    # -- the manifest -----------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = sha256_fingerprint(canonical_json(self._manifest_body()))
        return self._fingerprint

    def manifest_bytes(self) -> bytes:
        """The manifest as file bytes, encoded once: the canonical body with the fingerprint
        appended as its last key (JSON readers do not care about key order)."""
        body = canonical_json(self._manifest_body())
        self._fingerprint = sha256_fingerprint(body)
        return body[:-1] + b',"fingerprint":"' + self._fingerprint.encode() + b'"}'

    def _manifest_body(self, eval_examples: list[InputExample] | None = None) -> dict[str, Any]:
        evals = self.eval_examples if eval_examples is None else eval_examples
        return {
            "format": MANIFEST_FORMAT,
            "config": self.config.to_dict(),
            "examples": [example.to_dict() for example in self.examples],
            "eval_examples": [example.to_dict() for example in evals or ()],
            "microbatches": [microbatch.to_dict() for microbatch in self._schedule],
            "selection": self.selection_policy,
        }

    def to_manifest(self, eval_examples: Iterable[InputExample] | None = None) -> dict[str, Any]:
        """The JSON-able manifest; ``eval_examples`` given here replace the constructor's."""
        if eval_examples is not None:
            eval_examples = list(eval_examples)
            check_examples(eval_examples, self.config, what="eval example")
        body = self._manifest_body(eval_examples)
        if eval_examples is None and self._fingerprint is not None:
            body["fingerprint"] = self._fingerprint
        else:
            body["fingerprint"] = sha256_fingerprint(canonical_json(body))
        return body

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> ManagedTrainingPlan:
        """Rebuild a plan from its manifest, refusing one whose fingerprint does not verify."""
        if not isinstance(manifest, dict):
            raise ValueError("a manifest must be a JSON object")
        body = {key: value for key, value in manifest.items() if key != "fingerprint"}
        claimed = manifest.get("fingerprint")
        actual = manifest_fingerprint(manifest)
        if claimed != actual:
            raise ValueError(
                f"manifest fingerprint mismatch: it claims {claimed}, its content hashes to "
                f"{actual}; the manifest was changed after planning. Plan it again with "
                "`trainwire plan` (a manifest is written by the planner, never by hand)"
            )
        expected_keys = {"format", "config", "examples", "eval_examples", "microbatches"}
        missing = sorted(expected_keys - set(body))
        if missing:
            raise ValueError(f"manifest: missing key(s) {', '.join(missing)}")
        if body["format"] != MANIFEST_FORMAT:
            raise ValueError(f"manifest: format {body['format']!r} is not {MANIFEST_FORMAT!r}")
        config = TrainingConfig.from_dict(body["config"])
        examples = [InputExample.from_dict(item) for item in body["examples"]]
        evals = [InputExample.from_dict(item) for item in body["eval_examples"]]
        eval_examples = evals if evals else None
        _check_plan_inputs(examples, config, eval_examples)
        schedule = [_microbatch_from_dict(item, len(examples)) for item in body["microbatches"]]
        evaluates = config.eval_strategy != "no" and eval_examples is not None
        _check_schedule(schedule, len(examples), config, evaluates)
        plan = cls.__new__(cls)
        plan._init(examples, config, eval_examples, schedule)
        if body.get("selection") != plan.selection_policy:
            raise ValueError("manifest: the selection policy does not match its config")
        # The plan must write back exactly this manifest (no extra keys, no omitted defaults),
        # so its fingerprint is the manifest's own.
        if sha256_fingerprint(canonical_json(plan._manifest_body())) != actual:
            raise ValueError("manifest: not in canonical form (extra, missing or null fields)")
        plan._fingerprint = actual
        return plan


def _check_plan_inputs(
    examples: list[InputExample],
    config: TrainingConfig,
    eval_examples: list[InputExample] | None,
) -> None:
    if not isinstance(config, TrainingConfig):
        raise ValueError(f"config must be a TrainingConfig, got {type(config).__name__}")
    if not examples:
        raise ValueError("the training dataset is empty")
    check_examples(examples, config)
    if eval_examples is not None:
        check_examples(eval_examples, config, what="eval example")
    if config.eval_strategy != "no" and not eval_examples:
        raise ValueError(f"eval_strategy {config.eval_strategy!r} needs eval examples")


def _microbatch_from_dict(item: Any, row_count: int) -> Microbatch:
    if not isinstance(item, dict):
        raise ValueError("manifest: a microbatch must be an object")
    rows = item.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("manifest: a microbatch needs a non-empty list of rows")
    for row in rows:
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < row_count:
            raise ValueError(f"manifest: row {row!r} is outside the examples 0..{row_count - 1}")
    flags = [item.get(key) for key in ("update", "epoch_end", "evaluate")]
    if not all(isinstance(flag, bool) for flag in flags) or not isinstance(item.get("epoch"), int):
        raise ValueError("manifest: a microbatch needs epoch, update, epoch_end and evaluate")
    return Microbatch(tuple(rows), item["epoch"], *flags)


def _check_schedule(
    schedule: list[Microbatch], row_count: int, config: TrainingConfig, evaluates: bool
) -> None:
    """A manifest's schedule must keep the plan's promises: epochs in order, every row once per
    epoch, full batches but the last of an epoch, updates after every accumulation and at each
    epoch end, evaluations only where there is something to evaluate."""
    if not schedule:
        raise ValueError("manifest: no microbatches")
    epochs: list[list[Microbatch]] = []
    for microbatch in schedule:
        if not epochs or epochs[-1][-1].epoch_end:
            epochs.append([])
        epochs[-1].append(microbatch)
    if [group[0].epoch for group in epochs] != list(range(config.num_epochs)):
        raise ValueError(f"manifest: epochs must run 0..{config.num_epochs - 1}, each once")
    accumulation = config.gradient_accumulation_steps
    for group in epochs:
        epoch = group[0].epoch
        if not group[-1].epoch_end:
            raise ValueError("manifest: the last microbatch must end an epoch")
        rows = [row for microbatch in group for row in microbatch.rows]
        if sorted(rows) != list(range(row_count)):
            raise ValueError(f"manifest: epoch {epoch} does not visit every row exactly once")
        for j, microbatch in enumerate(group):
            last = j == len(group) - 1
            if microbatch.epoch != epoch:
                raise ValueError(f"manifest: epoch {epoch} is interleaved with another")
            if len(microbatch.rows) > config.batch_size or (
                not last and len(microbatch.rows) != config.batch_size
            ):
                raise ValueError("manifest: only an epoch's last microbatch may be partial")
            if microbatch.update != ((j + 1) % accumulation == 0 or last):
                raise ValueError("manifest: updates must close every accumulation and epoch")
            if microbatch.evaluate and not evaluates:
                raise ValueError("manifest: an evaluation point without evaluation settings")


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """What a manifest's content hashes to: the canonical JSON of everything but its claimed
    ``fingerprint`` (a manifest is verified by comparing the two)."""
    body = {key: value for key, value in manifest.items() if key != "fingerprint"}
    return sha256_fingerprint(canonical_json(body))
