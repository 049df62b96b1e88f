"""Sampling sessions: which weights a SamplingClient samples.

The engine samples its live weights, and keeps no second copy, so a sampling client stays usable
while the weights are those of its snapshot: until the next ``optim_step`` or ``load_weights``.
After that its samples are refused (a clear user error naming the fix: save a new snapshot), never
drawn from weights trained after it. This costs nothing to keep; the doc loops (save, sample,
train, repeat) never notice it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from trainwire.server.errors import FailedPrecondition, NotFound


@dataclass(frozen=True)
class Sampler:
    sampling_session_id: str
    base_model: str
    model_path: str | None
    weights_version: int  # the trainer's weights version the snapshot holds
    snapshot_seq: int  # the training seq_id that took it (0: the base model)


class Samplers:
    """The server's sampling sessions and named sampler snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.weights_version = 0
        self._sessions: dict[str, Sampler] = {}
        self._named: dict[str, tuple[int, int]] = {}  # tinker path → (version, seq_id)

    def weights_changed(self) -> None:
        with self._lock:
            self.weights_version += 1

    def create(
        self, sampling_id: str, base_model: str, model_path: str | None, snapshot_seq: int
    ) -> Sampler:
        with self._lock:
            sampler = self._sessions.get(sampling_id)
            if sampler is None:
                sampler = Sampler(
                    sampling_id, base_model, model_path, self.weights_version, snapshot_seq
                )
                self._sessions[sampling_id] = sampler
            return sampler

    def name_snapshot(self, path: str, snapshot_seq: int) -> None:
        with self._lock:
            self._named.setdefault(path, (self.weights_version, snapshot_seq))

    def create_from(self, sampling_id: str, base_model: str, model_path: str | None) -> Sampler:
        """A sampling session on a named snapshot, or on the base model (``model_path`` None)."""
        with self._lock:
            if sampling_id in self._sessions:
                return self._sessions[sampling_id]
            if model_path is None:
                version, seq = 0, 0
            elif model_path in self._named:
                version, seq = self._named[model_path]
            else:
                raise NotFound(
                    f"no sampler weights {model_path!r} on this server; save_weights_for_sampler"
                    " them first"
                )
            sampler = Sampler(sampling_id, base_model, model_path, version, seq)
            self._sessions[sampling_id] = sampler
            return sampler

    def get(self, sampling_id: str) -> Sampler:
        with self._lock:
            sampler = self._sessions.get(sampling_id)
        if sampler is None:
            raise NotFound(f"no sampling session {sampling_id!r}; create a sampling client first")
        return sampler

    def check_live(self, sampler: Sampler) -> None:
        """FailedPrecondition once the trainer's weights moved past the sampler's snapshot."""
        if sampler.weights_version != self.weights_version:
            raise FailedPrecondition(
                f"sampling session {sampler.sampling_session_id!r} holds weights the trainer has "
                "since updated; this server samples live weights only: call "
                "save_weights_and_get_sampling_client() again for the current weights"
            )
