"""``trainwire inspect PATH``: a human description of a manifest, a session checkpoint, an
export, or a server's state directory (its runs). A manifest is described without torch; its
fingerprint is verified on the way.

Checkpoints and exports are the server's files, so their names come from the server's modules
(defined once there). Those modules import torch, so they are imported only once ``PATH`` is a
directory: inspecting a manifest stays torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwire.contract.planning.manifest import read_manifest
from trainwire.contract.planning.plan import ManagedTrainingPlan, manifest_fingerprint


def describe_path(path: Path) -> str:
    """Describe whatever ``path`` is; ValueError when it is none of the three."""
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_file():
        return describe_manifest(path)
    from trainwire.server.engine.session.checkpoint import SESSION_FILE
    from trainwire.server.engine.weights.transfer import EXPORT_FILE

    if (path / SESSION_FILE).is_file():
        return describe_checkpoint(path)
    if (path / EXPORT_FILE).is_file():
        return describe_export(path)
    from trainwire.server.service.state_dir import LOCK_FILE, RUNS_DIR

    if (path / RUNS_DIR).is_dir() and (path / LOCK_FILE).is_file():
        return describe_state_dir(path)
    raise ValueError(
        f"{path}: neither a manifest, a session checkpoint, a trainwire export nor a server's "
        "state directory"
    )


def describe_manifest(path: Path) -> str:
    """A human summary of a manifest; its fingerprint is verified on the way (and a mismatch
    said first)."""
    manifest = read_manifest(path)
    claimed, actual = manifest.get("fingerprint"), manifest_fingerprint(manifest)
    # A hand-edited manifest is shown as it now is, with the mismatch said first: a run refuses
    # it, and seeing what changed is how one decides to plan again.
    verified = claimed == actual
    plan = ManagedTrainingPlan.from_manifest(dict(manifest, fingerprint=actual))
    config = plan.config
    policy = plan.selection_policy
    evaluations = [i for i in range(plan.batch_count) if plan.evaluates_after(i)]
    lora = config.lora
    lines = [
        f"manifest     {path}",
        f"format       {manifest['format']}",
        f"fingerprint  {plan.fingerprint} (verified)"
        if verified
        else f"fingerprint  DOES NOT VERIFY: it claims {claimed}, its content hashes to "
        f"{actual}; it was changed after planning, and a run refuses it: plan it again",
        f"model        {config.model} ({config.task}, "
        + (f"LoRA r={lora.r} alpha={lora.alpha}" if lora else "full weights")
        + f", {config.precision})",
        f"examples     {len(plan.examples)} training, {len(plan.eval_examples or ())} evaluation",
        f"batches      {plan.batch_count} microbatches of up to {config.batch_size}, "
        f"accumulation {config.gradient_accumulation_steps}",
        f"epochs       {config.num_epochs}",
        f"updates      {plan.max_steps}",
        f"evaluations  {len(evaluations)} ({config.eval_strategy})"
        + (f" after microbatches {_abbreviate(evaluations)}" if evaluations else ""),
        f"selection    {policy['metric']} ({policy['mode']}), early stopping "
        + (
            f"after {policy['patience']} evaluation(s) without gain"
            if policy["patience"]
            else "off"
        ),
    ]
    return "\n".join(lines)


def _abbreviate(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _files(directory: Path) -> str:
    sizes = sorted(
        (p.relative_to(directory).as_posix(), p.stat().st_size)
        for p in directory.rglob("*")
        if p.is_file()
    )
    return ", ".join(f"{name} ({size:,} B)" for name, size in sizes)


def describe_checkpoint(path: Path) -> str:
    """A session checkpoint's step, digest, config and files, from its ``session.json``; a
    sharded one's world size and tensors digest too."""
    from trainwire.server.engine.session.checkpoint import SESSION_FILE, is_sharded_checkpoint

    meta = _read_json(path / SESSION_FILE)
    config = meta.get("config", {})
    extra = meta.get("extra") or {}
    lines = [
        f"checkpoint   {path}",
        f"format       {meta.get('format')}",
        *(_sharding(meta) if is_sharded_checkpoint(path) else []),
        f"model        {config.get('model')} ({config.get('task')}, "
        + ("LoRA" if config.get("lora") else "full weights")
        + f", {config.get('precision')}, {meta.get('device_type')})",
        f"config       {meta.get('config_fingerprint')}",
        f"step         {meta.get('step')} of {meta.get('max_steps')}, "
        f"{meta.get('accumulated')} microbatch(es) accumulated",
        f"state digest {meta.get('state_digest')}",
    ]
    if "server" in extra:
        server = extra["server"]
        lines.append(
            f"server       run {server.get('run_id')}, position {server.get('position')}, "
            f"saved by {server.get('operation_key')}"
        )
    if "managed" in extra:
        managed = extra["managed"]
        lines.append(
            f"managed run  plan {managed.get('plan_fingerprint')}, next microbatch "
            f"{managed.get('next_microbatch')}, finished {managed.get('finished')}"
        )
    lines.append(f"files        {_files(path)}")
    return "\n".join(lines)


def _sharding(meta: dict[str, Any]) -> list[str]:
    """What a sharded checkpoint adds: the ranks it was written by, the digest of its tensors
    alone (equal on every world size; the state digest holds the ranks' RNG too)."""
    return [
        f"world size   {meta.get('world_size')} (sharded: loads on any world size, bit for bit "
        "on this one)",
        f"tensors      {meta.get('tensors_digest')}",
    ]


def describe_export(path: Path) -> str:
    """An export's kind, step, digest and files, from the record the server wrote beside it."""
    from trainwire.server.engine.weights.transfer import EXPORT_FILE

    record = _read_json(path / EXPORT_FILE)
    config = record.get("config", {})
    lines = [
        f"export       {path}",
        f"format       {record.get('format')}",
        f"kind         {record.get('kind')} ("
        + (
            "loads with peft on its base model"
            if record.get("kind") == "adapter"
            else "loads with transformers"
        )
        + ")",
        f"model        {config.get('model')} ({config.get('task')})",
        f"config       {record.get('config_fingerprint')}",
        f"step         {record.get('step')}",
        f"state digest {record.get('state_digest')}",
    ]
    if record.get("base_model_fingerprint"):
        lines.append(f"base model   {record['base_model_fingerprint']}")
    if record.get("checkpoint"):
        lines.append(f"from         checkpoint {record['checkpoint']}")
    lines.append(f"files        {_files(path)}")
    return "\n".join(lines)


def describe_state_dir(path: Path) -> str:
    """A state directory's runs: each one's state, model, position (its journal's last live
    entry), checkpoints and exports. Read only: a server may be using the directory meanwhile
    (its lock is not taken), and the ledger is opened read-only."""
    from trainwire.server.service.state_dir import RUN_FILE, RUNS_DIR, RunDirectory

    runs = sorted(p for p in (path / RUNS_DIR).iterdir() if (p / RUN_FILE).is_file())
    lines = [f"state dir    {path}", f"runs         {len(runs)}"]
    for folder in runs:
        run = RunDirectory(folder)
        spec = run.read_spec()
        config = spec.config
        journal = journal_summary(path, spec.run_id)
        position, last_key = journal.position, journal.last_key
        checkpoints = sorted(p.name for p in run.checkpoint_paths())
        found = run.exports.iterdir() if run.exports.is_dir() else []
        exports = sorted(p.name for p in found if not p.name.startswith("."))  # none half written
        lines += [
            "",
            f"run          {spec.run_id} ({spec.state})",
            f"model        {config.get('model')} ("
            + ("LoRA" if config.get("lora") else "full weights")
            + f", {config.get('task')})",
            f"config       {spec.config_fingerprint}",
            f"position     {position}" + (f" (last {last_key})" if last_key else ""),
            f"checkpoints  {_abbreviated_names(checkpoints)}",
            f"exports      {_abbreviated_names(exports)}",
        ]
    return "\n".join(lines)


@dataclass(frozen=True)
class JournalSummary:
    """A journal's last live entry: its position, key, kind and when it was recorded (position
    0, "" and None without one)."""

    position: int = 0
    last_key: str = ""
    last_kind: str = ""
    last_at: float | None = None


def journal_summary(state_dir: Path, run_id: str) -> JournalSummary:
    """What run ``run_id``'s journal (its rows of ``state_dir``'s ledger) says of its last live
    entry, read without writing anything."""
    import sqlite3

    from trainwire.server.service.ledger import ledger_path

    path = ledger_path(state_dir)
    if not path.is_file():
        return JournalSummary()
    # Without a write-ahead log beside it the file holds every entry: read it as immutable, so
    # not even SQLite's shared-memory index is created. With one (a server has it open), read
    # through it.
    wal = path.with_name(path.name + "-wal")
    mode = "mode=ro" if wal.exists() else "mode=ro&immutable=1"
    db = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True)
    try:
        row = db.execute(
            "SELECT position, operation_key, kind, recorded_at FROM operations "
            "WHERE run = ? AND rolled_back = 0 ORDER BY position DESC LIMIT 1",
            (run_id,),
        ).fetchone()
    finally:
        db.close()
    if row is None:
        return JournalSummary()
    return JournalSummary(int(row[0]), str(row[1]), str(row[2]), float(row[3]))


def _abbreviated_names(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"
