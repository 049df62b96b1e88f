"""Per-model sequencing: the SDK numbers a training client's calls with ``seq_id`` from 1 and may
send them out of order (a big batch's chunks go in parallel, the first one last). Each call runs
only after every lower ``seq_id`` of its model has run; later ones wait, up to a bound.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

from trainwire.server.errors import AlreadyExists, ResourceExhausted

DEFAULT_MAX_HELD = 1024  # calls of one model waiting for an earlier seq_id; more is refused (429)

Job = Callable[[], None]


def digest(value: Any) -> str:
    """What a seq_id is bound to: a re-send must carry the same payload."""
    data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


class SeqOrder:
    """Releases each model's jobs to ``run`` in ``seq_id`` order, one at a time.

    ``run`` is called on a thread of this object's own, never on the caller's, so an HTTP handler
    returns its request id at once.
    """

    def __init__(self, run: Callable[[Job], None], *, max_held: int = DEFAULT_MAX_HELD) -> None:
        self._run = run
        self._max_held = max_held
        self._lock = threading.Condition()
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, tuple[str, Job]]] = {}
        self._seen: dict[tuple[str, int], str] = {}  # (model, seq) → payload digest
        self._ready: list[Job] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tinker-order", daemon=True)
        self._thread.start()

    def start_model(self, model_id: str, next_seq: int = 1) -> None:
        with self._lock:
            self._next[model_id] = max(self._next.get(model_id, next_seq), next_seq)
            self._held.setdefault(model_id, {})

    def accepts(self, model_id: str, seq_id: int, digest: str) -> bool:
        """Whether ``submit`` would queue this call: False for a re-send (the same seq_id with
        the same payload, whose future already exists).

        Raises ``AlreadyExists`` for the same seq_id with another payload, ``ResourceExhausted``
        when too many later calls already wait for an earlier one.
        """
        with self._lock:
            seen = self._seen.get((model_id, seq_id))
            if seen is not None:
                if seen != digest:
                    raise AlreadyExists(
                        f"seq_id {seq_id} of model {model_id!r} was already sent with another "
                        "payload; a new call needs a new seq_id"
                    )
                return False
            if seq_id < self._next[model_id]:
                raise AlreadyExists(
                    f"seq_id {seq_id} of model {model_id!r} is before the next expected "
                    f"({self._next[model_id]}) and was never sent to this server"
                )
            held = self._held[model_id]
            if len(held) >= self._max_held and seq_id != self._next[model_id]:
                raise ResourceExhausted(
                    f"{len(held)} calls of model {model_id!r} wait for seq_id "
                    f"{self._next[model_id]}; send it first"
                )
            return True

    def submit(self, model_id: str, seq_id: int, digest: str, job: Job) -> bool:
        """Queue ``job`` as ``seq_id`` of ``model_id`` (see ``accepts``; False for a re-send)."""
        with self._lock:
            if not self.accepts(model_id, seq_id, digest):
                return False
            self._seen[(model_id, seq_id)] = digest
            self._held[model_id][seq_id] = (digest, job)
            self._release(model_id)
            return True

    def check_room(self) -> None:
        """ResourceExhausted when ``max_held`` jobs already wait to run (a flood of samples)."""
        with self._lock:
            if len(self._ready) >= self._max_held:
                raise ResourceExhausted(f"{len(self._ready)} calls wait to run; retry later")

    def run_unordered(self, job: Job) -> None:
        """Queue a job outside any model's sequence (sampling), behind what is ready now."""
        with self._lock:
            self._ready.append(job)
            self._lock.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    def _release(self, model_id: str) -> None:
        held = self._held[model_id]
        while self._next[model_id] in held:
            _, job = held.pop(self._next[model_id])
            self._next[model_id] += 1
            self._ready.append(job)
        self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._ready and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                job = self._ready.pop(0)
            self._run(job)
