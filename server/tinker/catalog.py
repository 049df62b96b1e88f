"""The catalog: every SDK training run this server has held and the checkpoints it saved under a
name, kept after the run closes, so a later session can list them, read their metadata, sample
them, download them or start a new run from them (``tinker://<model_id>/<kind>/<name>``).

One JSON file per run (``catalog/<run_id>.json`` in the front's directory), written atomically
after every change. The files themselves stay where the host wrote them (the run's checkpoints
and exports); the catalog says which are live, when each expires (its TTL, as Tinker keeps one)
and which removals wait: the open run's newest checkpoint is its recovery point, so deleting it
hides it at once and removes its files once a newer one supersedes it.

A checkpoint its owner published (``set_public``) is found by every tenant of this server, to
load, sample, start a run from or download; its run, the listings and its removal stay the
owner's.

An entry is written after the call that saved it is journaled: a call killed between the two is
run again from the request store, finds its journaled result, and writes the entry then.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainwire.contract.files import write_text_atomic
from trainwire.server.errors import InvalidArgument, NotFound
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.tenancy import visible

CATALOG_DIR = "catalog"
PATH_PREFIX = "tinker://"
# The path segment of each kind of checkpoint, and the SDK's name for the kind.
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
MIN_TTL_S = 3600  # Tinker's bounds for a checkpoint's time to live: one hour ...
MAX_TTL_S = 10 * 365 * 24 * 3600  # ... to ten years


def iso(seconds: float) -> str:
    """A Unix time as the SDK's ``datetime`` fields read it."""
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def check_ttl(ttl_seconds: Any, what: str) -> int | None:
    """A TTL in seconds within Tinker's bounds, or None (never expires)."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise InvalidArgument(f"{what}: ttl_seconds must be an integer, got {ttl_seconds!r}")
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidArgument(
            f"{what}: ttl_seconds must be between {MIN_TTL_S} (one hour) and {MAX_TTL_S} "
            f"(ten years), or null for no expiry; got {ttl_seconds}"
        )
    return ttl_seconds


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<model_id>/<segment>/<name>``, parsed."""

    model_id: str
    segment: str  # weights, sampler_weights or external_weights
    name: str

    @classmethod
    def parse(cls, path: Any) -> TinkerPath:
        parts = path[len(PATH_PREFIX) :].split("/") if isinstance(path, str) else []
        if (
            not isinstance(path, str)
            or not path.startswith(PATH_PREFIX)
            or len(parts) != 3
            or parts[1] not in KINDS
            or not all(parts)
        ):
            raise InvalidArgument(
                f"path {path!r}: give tinker://<training run id>/<weights|sampler_weights|"
                "external_weights>/<name>, as save_state or save_weights_for_sampler returned it"
            )
        return cls(parts[0], parts[1], parts[2])

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    def __str__(self) -> str:
        return f"{PATH_PREFIX}{self.model_id}/{self.checkpoint_id}"


@dataclass(frozen=True)
class SavedCheckpoint:
    """A named checkpoint: ``stored_as`` is the run's checkpoint (training) or export (sampler,
    external) folder that holds it."""

    checkpoint_id: str  # <segment>/<name>
    stored_as: str
    created_s: float
    size_bytes: int
    expires_s: float | None = None
    saved_by: str = ""  # the request that saved it: its replay keeps this record, a new save not
    public: bool = False  # published: every tenant of this server may read it (``set_public``)

    @property
    def segment(self) -> str:
        return self.checkpoint_id.split("/", 1)[0]

    def expired(self, now: float) -> bool:
        return self.expires_s is not None and now >= self.expires_s

    def to_sdk(self, model_id: str) -> dict[str, Any]:
        """The SDK's ``Checkpoint``."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": KINDS[self.segment],
            "time": iso(self.created_s),
            "tinker_path": f"{PATH_PREFIX}{model_id}/{self.checkpoint_id}",
            "size_bytes": self.size_bytes,
            "public": self.public,
            "expires_at": None if self.expires_s is None else iso(self.expires_s),
        }


@dataclass
class TrainingRunRecord:
    """An SDK training run: what ``get_training_run`` and ``weights_info`` answer, the config a
    new run started from its checkpoints takes, and its live checkpoints."""

    model_id: str
    base_model: str
    lora_rank: int | None
    config: dict[str, Any]  # the run's TrainingConfig.to_dict()
    switches: dict[str, bool]  # train_attn, train_mlp, train_unembed as created
    user_metadata: dict[str, str]
    created_s: float
    last_request_s: float
    checkpoints: dict[str, SavedCheckpoint] = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)  # checkpoint folders still to remove
    # A run made by ``copy_weights``: the key it was copied under, and its request's digest.
    copy_key: str = ""
    copy_digest: str = ""

    @property
    def run_id(self) -> str:
        return run_id_for(self.model_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainingRunRecord:
        data = json.loads(text)
        data["checkpoints"] = {
            key: SavedCheckpoint(**value) for key, value in data["checkpoints"].items()
        }
        return cls(**data)

    def latest(self, segment: str) -> SavedCheckpoint | None:
        kind = [c for c in self.checkpoints.values() if c.segment == segment]
        return max(kind, key=lambda c: c.created_s) if kind else None

    def to_sdk(self) -> dict[str, Any]:
        """The SDK's ``TrainingRun``."""
        latest = {s: self.latest(s) for s in ("weights", "sampler_weights")}
        return {
            "training_run_id": self.model_id,
            "base_model": self.base_model,
            "model_owner": "trainwire",
            "is_lora": self.lora_rank is not None,
            "corrupted": False,
            "lora_rank": self.lora_rank,
            "last_request_time": iso(self.last_request_s),
            "last_checkpoint": _checkpoint_to_sdk(latest["weights"], self.model_id),
            "last_sampler_checkpoint": _checkpoint_to_sdk(latest["sampler_weights"], self.model_id),
            "user_metadata": self.user_metadata or None,
        }


def _checkpoint_to_sdk(checkpoint: SavedCheckpoint | None, model_id: str) -> dict[str, Any] | None:
    return None if checkpoint is None else checkpoint.to_sdk(model_id)


class Catalog:
    """The runs and their named checkpoints, durable in ``directory/catalog``."""

    def __init__(self, directory: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.directory = directory / CATALOG_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        # Held while a checkpoint is removed and while a load that names one is accepted: a
        # removal then either sees the load's logged request (and is refused) or comes first
        # (and the load is not found), never between the two. Re-entrant: a sweep holds it
        # across the deletes it makes (``saved_checkpoints.sweep``).
        self.removal_guard = threading.RLock()
        # Samples being accepted now, by the canonical path of the sampler weights they read
        # (under ``removal_guard``): a delete sees them as it sees accepted ones.
        self.samples_accepting: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._runs: dict[str, TrainingRunRecord] = {}
        for path in sorted(self.directory.glob("*.json")):
            record = TrainingRunRecord.from_json(path.read_text())
            self._runs[record.model_id] = record

    def _save(self, record: TrainingRunRecord) -> None:
        write_text_atomic(self.directory / f"{record.run_id}.json", record.to_json())

    # -- runs ------------------------------------------------------------------------------------

    def add_run(self, record: TrainingRunRecord) -> None:
        """Record a run as it is created (again: a create retried keeps its first record);
        listed only once its file is written, so a record that cannot be written is nowhere."""
        with self._lock:
            if record.model_id not in self._runs:
                self._save(record)
                self._runs[record.model_id] = record

    def run(self, model_id: str) -> TrainingRunRecord:
        """Run ``model_id``; NotFound when there is none (for the caller: ``tenancy``)."""
        with self._lock:
            record = self._runs.get(model_id)
        if record is None or not visible(model_id):
            raise NotFound(f"no training run {model_id!r} on this server")
        return record

    def run_of_any_tenant(self, model_id: str) -> TrainingRunRecord | None:
        """Run ``model_id`` whoever holds it (None: none): for the server's own checks, such as
        whether a model id is taken, never to answer a caller with."""
        with self._lock:
            return self._runs.get(model_id)

    def runs(self) -> list[TrainingRunRecord]:
        """Every run the caller may see, newest first."""
        with self._lock:
            records = [r for r in self._runs.values() if visible(r.model_id)]
        return sorted(records, key=lambda r: -r.created_s)

    # -- checkpoints -----------------------------------------------------------------------------

    def add_checkpoint(self, path: TinkerPath, saved: SavedCheckpoint) -> SavedCheckpoint | None:
        """Record ``saved`` under ``path``; returns the record it replaced, if any.

        The same request recorded again (its replay after a crash) keeps the first record;
        another save under a used name wrote new files, so its record (time, size, TTL)
        replaces the old one too."""
        with self._lock:
            record = self._require(path.model_id)
            existing = record.checkpoints.get(path.checkpoint_id)
            if existing is not None and existing.saved_by == saved.saved_by:
                return None
            record.checkpoints[path.checkpoint_id] = saved
            record.last_request_s = saved.created_s
            self._save(record)
            return existing

    def find(self, path: TinkerPath) -> tuple[TrainingRunRecord, SavedCheckpoint]:
        """The run and checkpoint ``path`` names; NotFound when it is not (or no longer) there.
        (A load accepted before the checkpoint expired is queued again after a restart from
        its stored request, which names the folder it found: it is not looked up again.)"""
        with self._lock:
            record = self._runs.get(path.model_id)
            saved = None if record is None else record.checkpoints.get(path.checkpoint_id)
        if saved is not None and not saved.public and not visible(path.model_id):
            saved = None  # another tenant's, unpublished: as if it were not there
        if record is None or saved is None or saved.expired(self.clock()):
            raise NotFound(f"no checkpoint {str(path)!r} on this server (deleted or expired?)")
        return record, saved

    def checkpoints(self, model_id: str) -> list[SavedCheckpoint]:
        """A run's live checkpoints, oldest first."""
        record, now = self.run(model_id), self.clock()
        with self._lock:
            live = [c for c in record.checkpoints.values() if not c.expired(now)]
        return sorted(live, key=lambda c: c.created_s)

    def remove(self, path: TinkerPath) -> SavedCheckpoint:
        """Take ``path`` out of the catalog, expired or not (removing what expired is how it
        goes); its files are the caller's to remove. NotFound when it is not there."""
        with self._lock:
            record = self._runs.get(path.model_id) if visible(path.model_id) else None
            saved = None if record is None else record.checkpoints.pop(path.checkpoint_id, None)
            if record is None or saved is None:
                raise NotFound(f"no checkpoint {str(path)!r} on this server (deleted or expired?)")
            self._save(record)
        return saved

    def set_ttl(self, path: TinkerPath, ttl_seconds: int | None) -> None:
        """Expire ``path`` ``ttl_seconds`` from now (None: never); its owner's alone, even
        published."""
        self.run(path.model_id)
        self.find(path)
        with self._lock:
            record = self._runs[path.model_id]
            saved = record.checkpoints[path.checkpoint_id]
            expires = None if ttl_seconds is None else self.clock() + ttl_seconds
            record.checkpoints[path.checkpoint_id] = replace(saved, expires_s=expires)
            self._save(record)

    def set_public(self, path: TinkerPath, public: bool) -> None:
        """Publish ``path`` to every tenant of this server, or take it back (its owner only:
        another tenant's answer is NotFound, as for one that is not there)."""
        self.run(path.model_id)
        self.find(path)
        with self._lock:
            record = self._runs[path.model_id]
            saved = record.checkpoints[path.checkpoint_id]
            if saved.public != public:
                record.checkpoints[path.checkpoint_id] = replace(saved, public=public)
                self._save(record)

    def stored_in(self, run_id: str, folder: str) -> list[TinkerPath]:
        """The training checkpoints of run ``run_id`` whose files are its checkpoint folder
        ``folder``, whoever holds them: for the server's own checks (what a save under that
        name would write over), never to answer a caller with."""
        with self._lock:
            return [
                TinkerPath(record.model_id, *checkpoint_id.split("/", 1))
                for record in self._runs.values()
                if record.run_id == run_id
                for checkpoint_id, saved in record.checkpoints.items()
                if saved.segment == "weights" and saved.stored_as == folder
            ]

    def expired(self) -> list[TinkerPath]:
        """Every checkpoint past its TTL, to remove."""
        now = self.clock()
        with self._lock:
            return [
                TinkerPath(record.model_id, *checkpoint_id.split("/", 1))
                for record in self._runs.values()
                for checkpoint_id, saved in record.checkpoints.items()
                if saved.expired(now)
            ]

    def set_deferred(self, model_id: str, names: list[str]) -> None:
        """The checkpoint folders of ``model_id`` whose removal waits (see the module's note)."""
        with self._lock:
            record = self._require(model_id)
            if record.deferred != names:
                record.deferred = list(names)
                self._save(record)

    def _require(self, model_id: str) -> TrainingRunRecord:
        record = self._runs.get(model_id)
        if record is None:
            raise NotFound(f"no training run {model_id!r} on this server")
        return record
