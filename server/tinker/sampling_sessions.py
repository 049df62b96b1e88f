"""Sampling sessions: which weights a SamplingClient samples.

A sampling client samples the weights of its snapshot, never weights trained after it. Each
``save_weights_for_sampler`` writes its snapshot as an export of the run (see
``sampling_routes``); while the trainer has not changed its weights since, samples read the live
weights at no cost, afterwards the engine swaps the export in for the call. Disk stays bounded:
the newest ``KEEP_UNNAMED_SNAPSHOTS`` unnamed snapshots of each model are kept (named ones,
saved under a ``path``, are never pruned); sampling an older one is refused with a clear
error. Closing a
model forgets the sampling sessions of its snapshots (``end_model``), and forgetting an SDK
session forgets its own (``forget``).

Each snapshot names the model that took it (``model_id``; many models may train on one server)
and the version of its run's live weights it holds (``SessionHost.weights_version``, counted by
the engine in this process: every update and load moves it). A sample of the snapshot names
both, and the service decides at the sample's turn whether the live weights are still the
snapshot's (``SampleRequest.live_at``): this front keeps no count of its own, so nothing it
does after an update or a load has to run before the next sample. A snapshot restored from the
request store has no version (it was counted by another process): it always reads its export.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from trainwire.server.errors import NotFound
from trainwire.server.service.request_records import NoteRecord, Record
from trainwire.server.tinker.sdk_sessions import session_of
from trainwire.server.tinker.tenancy import visible

KEEP_UNNAMED_SNAPSHOTS = 8
SNAPSHOT_PREFIX = "sampler-"
# The kinds of the notes this module keeps in the request store (``NoteRecord``).
SAMPLER_NOTE = "sampler"  # a sampling session, or (``named``) sampler weights saved under a path
UNNAMED_SNAPSHOTS_NOTE = "unnamed_snapshots"  # which unnamed snapshot exports exist, oldest first
INFLIGHT_NOTE = "inflight"  # the snapshot a model's inflight sampling sessions read now


def snapshot_export(seq_id: int, name: str | None) -> str:
    """The run's export that holds a snapshot: by its name, else by the call's seq_id."""
    return f"{SNAPSHOT_PREFIX}{name}" if name else f"{SNAPSHOT_PREFIX}seq-{seq_id}"


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str
    base_model: str
    model_path: str | None  # the tinker path it samples (None: the base model or unnamed)
    export: str | None  # the run's export holding its weights (None: the base model)
    snapshot_seq: int  # the training seq_id that took it (0: the base model)
    weights_version: int | None = None  # its run's weights version it holds (None: unknown)
    export_run: str = ""  # the run that saved ``export``, when another (closed) run did
    model_id: str = ""  # the model that took the snapshot ("": none, it samples the base model)
    inflight: bool = False  # reads its model's inflight weights, not its own snapshot

    def record(self, *, named: bool = False) -> NoteRecord:
        """What the request store keeps of it (the version is this process's only): named sampler
        weights outlive the SDK session that saved them, a sampling session goes with its own."""
        fields = asdict(self)
        del fields["weights_version"]
        if named:
            return NoteRecord(SAMPLER_NOTE, {**fields, "named": True})
        return NoteRecord(SAMPLER_NOTE, fields, session_of(self.sampling_session_id))


class SamplingSessions:
    """The server's sampling sessions, named snapshots and unnamed snapshot exports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[str, SamplingSession] = {}
        self._named: dict[str, SamplingSession] = {}  # tinker path → its snapshot
        self._unnamed: dict[str, list[str]] = {}  # model id → its unnamed snapshots, oldest first
        # Sampling sessions a snapshot call was accepted for and has not made yet: their model.
        self._expected: dict[str, str] = {}
        # Each model's inflight weights: the snapshot of its latest inflight save.
        self._inflight: dict[str, SamplingSession] = {}

    def snapshot(
        self,
        model_id: str,
        sampling_id: str | None,
        path: str | None,
        base_model: str,
        export: str,
        seq: int,
        weights_version: int,
        *,
        inflight: bool = False,
    ) -> list[str]:
        """Register a snapshot ``model_id`` just wrote at its run's ``weights_version`` (a
        named ``path`` or a sampling session); returns that model's unnamed snapshot exports
        now beyond what is kept, for the caller to remove. ``inflight``: the sampling session
        reads the model's inflight weights, which move to this snapshot (also for its inflight
        sessions made before: the newest inflight snapshot is always among the unnamed ones
        kept)."""
        with self._lock:
            sampler = SamplingSession(
                sampling_id or "", base_model, path, export, seq, weights_version, model_id=model_id
            )
            if path:
                self._named[path] = sampler
                return []
            assert sampling_id is not None
            if inflight:
                self._inflight[model_id] = sampler
                sampler = replace(sampler, sampling_session_id=sampling_id, inflight=True)
            self._sessions.setdefault(sampling_id, sampler)
            self._expected.pop(sampling_id, None)
            unnamed = self._unnamed.setdefault(model_id, [])
            if export not in unnamed:
                unnamed.append(export)
            pruned = unnamed[:-KEEP_UNNAMED_SNAPSHOTS]
            del unnamed[:-KEEP_UNNAMED_SNAPSHOTS]
            return pruned

    def target(self, sampler: SamplingSession) -> SamplingSession:
        """The snapshot ``sampler`` reads now: its own, or for an inflight one its model's
        latest inflight save (never older than its own)."""
        if not sampler.inflight:
            return sampler
        with self._lock:
            latest = self._inflight.get(sampler.model_id, sampler)
        return replace(latest, sampling_session_id=sampler.sampling_session_id, inflight=True)

    def expect(self, sampling_id: str, model_id: str) -> None:
        """A snapshot call of ``model_id`` that makes ``sampling_id`` was accepted."""
        with self._lock:
            self._expected[sampling_id] = model_id

    def model_of(self, sampling_id: str) -> str:
        """The model whose snapshot ``sampling_id`` samples, known or expected ("": none, or
        the base model): after a restart, samples of a sampling session that a replayed call
        makes again wait behind that call, in its model's turns."""
        with self._lock:
            sampler = self._sessions.get(sampling_id)
            return sampler.model_id if sampler is not None else self._expected.get(sampling_id, "")

    def pruned(self, sampler: SamplingSession) -> bool:
        """Whether ``sampler``'s unnamed snapshot is past its model's newest
        ``KEEP_UNNAMED_SNAPSHOTS`` (its export removed)."""
        with self._lock:
            unnamed = self._unnamed.get(sampler.model_id, [])
            return sampler.export is not None and (
                sampler.model_path is None and sampler.export not in unnamed
            )

    def end_model(self, model_id: str) -> None:
        """Model ``model_id`` closed: the sampling sessions of its snapshots end with it (its
        named sampler weights stay in the catalog, where a new sampling client finds them)."""
        with self._lock:
            self._sessions = {
                k: v for k, v in self._sessions.items() if v.model_id != model_id or v.export_run
            }
            self._named = {k: v for k, v in self._named.items() if v.model_id != model_id}
            self._unnamed.pop(model_id, None)
            self._inflight.pop(model_id, None)
            self._expected = {k: v for k, v in self._expected.items() if v != model_id}

    def named(self, path: str) -> bool:
        """Whether sampler weights ``path`` of the open model exist (and the caller's)."""
        with self._lock:
            return path in self._named and visible(path)

    def reading(self, reads: Callable[[str], bool]) -> set[str]:
        """Every sampling session, whoever's, whose sampler weights' path ``reads`` picks."""
        with self._lock:
            return {
                sampling_id
                for sampling_id, sampler in self._sessions.items()
                if sampler.model_path is not None and reads(sampler.model_path)
            }

    def forget_named(self, path: str) -> None:
        """Named sampler weights deleted: no new sampling client can be made on them."""
        with self._lock:
            self._named.pop(path, None)

    def create_from(
        self,
        sampling_id: str,
        base_model: str,
        model_path: str | None,
        saved_elsewhere: SamplingSession | None = None,
    ) -> SamplingSession:
        """A sampling session on a named snapshot, or on the base model (``model_path`` None);
        ``saved_elsewhere``: the snapshot as another run saved it (from the catalog), for a
        path this model did not save."""
        with self._lock:
            if sampling_id in self._sessions:
                return self._sessions[sampling_id]
            if model_path is not None and model_path not in self._named and saved_elsewhere:
                sampler = replace(saved_elsewhere, sampling_session_id=sampling_id)
            elif model_path is None:
                sampler = SamplingSession(sampling_id, base_model, None, None, 0, 0)
            elif model_path in self._named:
                named = self._named[model_path]
                sampler = replace(named, sampling_session_id=sampling_id, base_model=base_model)
            else:
                raise NotFound(
                    f"no sampler weights {model_path!r} on this server; save_weights_for_sampler"
                    " them first"
                )
            self._sessions[sampling_id] = sampler
            return sampler

    def forget(self, gone: Callable[[str], bool]) -> None:
        """Drop the sampling sessions whose id ``gone`` names (their SDK session ended); named
        snapshots stay: they belong to the model, not to a client."""
        with self._lock:
            self._sessions = {k: v for k, v in self._sessions.items() if not gone(k)}
            self._expected = {k: v for k, v in self._expected.items() if not gone(k)}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def require(self, sampling_id: str, *, replaying: bool) -> None:
        """NotFound unless ``sampling_id`` is a sampling session the caller may use, or, while
        a restart still replays its calls (``replaying``), one a replayed snapshot call is
        to make again (``expect``): its clients keep polling and sampling meanwhile."""
        with self._lock:
            coming = replaying and sampling_id in self._expected
        if not coming or not visible(sampling_id):
            self.get(sampling_id)

    def get(self, sampling_id: str) -> SamplingSession:
        with self._lock:
            sampler = self._sessions.get(sampling_id)
        if sampler is None or not visible(sampling_id):
            raise NotFound(
                f"no sampling session {sampling_id!r} (never created here, or it ended with its "
                "model or its ServiceClient's session); create a sampling client first"
            )
        return sampler

    # -- the request store -------------------------------------------------------------------------

    def records(self) -> list[Record]:
        """Every sampling session and named snapshot, for a compacted request store."""
        with self._lock:
            named: list[Record] = [s.record(named=True) for s in self._named.values()]
            sessions = [s.record() for s in self._sessions.values()]
            unnamed = [
                NoteRecord(UNNAMED_SNAPSHOTS_NOTE, {"exports": list(exports), "model_id": model})
                for model, exports in sorted(self._unnamed.items())
            ]
            inflight = [
                NoteRecord(INFLIGHT_NOTE, latest.record().fields)
                for latest in self._inflight.values()
            ]
            return [*named, *sessions, *unnamed, *inflight]

    def restore(self, note: NoteRecord) -> None:
        """Restore one of ``records``' notes (or a logged sampling session); ValueError for a
        note of another kind."""
        with self._lock:
            if note.kind == INFLIGHT_NOTE:
                latest = SamplingSession(**note.fields)
                self._inflight[latest.model_id] = latest
                return
            if note.kind == UNNAMED_SNAPSHOTS_NOTE:
                self._unnamed[note.fields["model_id"]] = list(note.fields["exports"])
                return
            if note.kind != SAMPLER_NOTE:
                raise ValueError(f"a request-store note of unknown kind {note.kind!r}")
            fields = dict(note.fields)
            named = bool(fields.pop("named", False))
            sampler = SamplingSession(**fields)
            if named:
                self._named[sampler.model_path or ""] = sampler
            else:
                self._sessions[sampler.sampling_session_id] = sampler
