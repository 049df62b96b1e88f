"""The Tinker front: the SDK's calls mapped onto the server's one ``SessionHost``.

Every training call of the SDK carries ``(model_id, seq_id)``; ``{model_id}/{seq_id}`` is both its
request id and its trainwire operation key, so a re-sent call finds its future (and, after it ran,
the journal's recorded result) instead of running again. Calls run in seq_id order per model
(``SeqOrder``); their results enter the ``FutureStore`` only once durable: a keyed call's journal
commit happens inside ``SessionHost`` before the host returns, and every other result (a forward,
a sample, a failure) is written to the ``RequestLog`` first.

Exactly once across a crash: each accepted request is in the ``RequestLog`` before its request id
is handed out. A restarted front reads it back before the listener serves: recorded results are
answered as they are, every other call is submitted again in its original order. The engine
restarted from its latest checkpoint, so the journal answers the keyed calls before it and the
ones since run again, the same bits; a forward or sample runs at the same point of the sequence
(or on its snapshot), so a pending poll gets what an uninterrupted run gives.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainwire.server.errors import FailedPrecondition, InvalidArgument, NotFound, TrainwireError
from trainwire.server.paths import resolve_under
from trainwire.server.service.host import SessionHost
from trainwire.server.tinker.fields import get_int, get_str
from trainwire.server.tinker.futures import (
    USER_ERRORS,
    Done,
    Failed,
    FutureStore,
    Outcome,
    run_to_outcome,
)
from trainwire.server.tinker.model import (
    ModelRecord,
)
from trainwire.server.tinker.model import training_config as config_of
from trainwire.server.tinker.ordering import SeqOrder, digest
from trainwire.server.tinker.request_log import (
    RequestLog,
    call_record,
    compacted,
    decode_body,
    outcome_of,
)
from trainwire.server.tinker.samplers import Samplers
from trainwire.server.tinker.sampling import SamplingRoutes
from trainwire.server.tinker.training import TrainingRoutes

logger = logging.getLogger(__name__)

FRONT_DIR = "tinker"  # the front's own files, beside the runs in the state directory
SESSION_LAPSE_S = 60.0  # a client silent this long (six missed heartbeats) gives up its model


class TinkerFront:
    """One server's SDK state: its sessions, the one model, its sampling sessions, futures."""

    def __init__(self, host: SessionHost, *, tokenizer_id: str | None = None) -> None:
        self.host = host
        self.tokenizer_id = tokenizer_id
        self.directory = Path(host.state_dir.root) / FRONT_DIR
        self.futures = FutureStore()
        self.log = RequestLog(self.directory)
        self._recovered = threading.Event()
        self._cannot_replay = ""  # why the restored engine is behind the request log, if it is
        self.order = SeqOrder(self._when_recovered)
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="tinker-finish")  # in order
        self.samplers = Samplers(restarted=bool(self.log.records))
        self.sessions: set[str] = set()
        self._seen: dict[str, float] = {}  # session → when it last sent a request (monotonic)
        self._started = time.monotonic()
        self.sampling = SamplingRoutes(self)
        self.training = TrainingRoutes(self)
        self._lock = threading.RLock()  # orders request records with their submission
        self._replayed: dict[str, Outcome] | None = None  # recorded results, while replaying
        self._resume_position = 0
        self._resubmitted: set[str] = set()  # request ids submitted again at start, unanswered
        self.model = ModelRecord.load(self.directory)
        if self.model is not None:
            self.sessions.add(self.model.session_id)
            self._resolve_create(self.model.model_id)
        self._replay(self.log.records)
        threading.Thread(target=self._await_recovery, name="tinker-recover", daemon=True).start()

    def stop(self) -> None:
        self.order.stop()
        self._finisher.shutdown()
        self.log.close()

    # -- restart -------------------------------------------------------------------------------

    def _replay(self, records: list[dict[str, Any]]) -> None:
        """Rebuild sessions, samplers and futures from the log; submit every unanswered call."""
        self._replayed = {r["request_id"]: outcome_of(r) for r in records if r["kind"] == "result"}
        routes: dict[str, Callable[..., Any]] = {
            "forward_backward": self.training.forward_backward,
            "optim_step": self.training.optim_step,
            "save_weights": self.training.save_weights,
            "load_weights": self.training.load_weights,
            "save_weights_for_sampler": self.sampling.save_weights_for_sampler,
        }
        try:
            for record in records:
                kind = record["kind"]
                if kind == "session":
                    self.sessions.add(record["session_id"])
                elif kind in ("sampler", "unnamed_snapshots"):
                    self.samplers.restore(record)
                elif kind == "resume" and self.model is not None:
                    self.order.start_model(self.model.model_id, record["next_seq"])
                    self._resume_position = record["position"]
                elif kind in ("call", "sample"):
                    self._resubmit(routes, record)
        finally:
            self._replayed = None
        if records:
            logger.info("Tinker front: %d request records read back", len(records))

    def _resubmit(self, routes: dict[str, Callable[..., Any]], record: dict[str, Any]) -> None:
        self._resubmitted.add(record["request_id"])
        try:
            if record["kind"] == "sample":
                self.sampling.asample(record["body"])
                return
            body = decode_body(record["body"])
            args = (body, record["encoding"]) if "encoding" in record else (body,)
            routes[record["route"]](*args)
        except (TrainwireError, ValueError) as error:  # refused again, or its model was closed
            logger.info("Tinker front: %s refused again: %s", record["request_id"], error)

    def replay_pending(self) -> bool:
        """Whether a call submitted again at start is unanswered yet (it may create a sampler)."""
        self._resubmitted = {r for r in self._resubmitted if self.futures.pending(r)}
        return self._replayed is not None or bool(self._resubmitted)

    def _await_recovery(self) -> None:
        """Let submitted calls run once the host restored its run (at once when none)."""
        self.host.recover()  # queued behind serve()'s own recovery: returns once it is done
        last = self.host.journal.last() if self.host.journal is not None else None
        position = last.position if last is not None else 0  # Info would hash the whole state
        if position < self._resume_position:
            self._cannot_replay = (
                f"the engine restored position {position}, before the checkpoint the request log "
                f"was compacted at ({self._resume_position}): this run cannot go on exactly once"
            )
            logger.error("Tinker front: %s", self._cannot_replay)
        self._recovered.set()

    def _when_recovered(self, job: Callable[[], None]) -> None:
        self._recovered.wait()
        job()

    def _record(self, record: dict[str, Any]) -> int | None:
        """Log a request (not while replaying one); its ticket for ``log.sync``."""
        return None if self._replayed is not None else self.log.append(record)

    def _encode_and_finish(self, request_id: str, outcome: Outcome, keyed: bool) -> None:
        """A call's response, once its engine work is done: ``Done(encode)`` is encoded here."""
        if isinstance(outcome, Done) and callable(outcome.body):
            outcome = run_to_outcome(outcome.body)
        self._finish(request_id, outcome, durable=keyed and isinstance(outcome, Done))

    def _finish(self, request_id: str, outcome: Outcome, *, durable: bool) -> None:
        """Resolve a future, writing its outcome to the log first unless already durable."""
        if not durable:
            outcome = self.log.write_result(request_id, outcome)
        self.futures.resolve(request_id, outcome)

    # -- sessions ------------------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = f"tw-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self.sessions.add(session_id)
            self.log.write({"kind": "session", "session_id": session_id})
        self._seen[session_id] = time.monotonic()
        return session_id

    def require_session(self, session_id: str) -> None:
        """NotFound for a session this server does not know; a known one counts as alive."""
        if session_id not in self.sessions:
            raise NotFound(f"no session {session_id!r} on this server; create_session first")
        self._seen[session_id] = time.monotonic()

    def _lapsed(self, session_id: str) -> bool:
        """No request and no heartbeat (the SDK sends one every 10 s) for SESSION_LAPSE_S;
        after a restart, counted from the restart."""
        return time.monotonic() - self._seen.get(session_id, self._started) > SESSION_LAPSE_S

    def finish_session(self, session_id: str) -> None:
        """The SDK closed its ServiceClient: its model's run closes (a new one may be created)."""
        self.require_session(session_id)
        with self._lock:
            self.sessions.discard(session_id)
            model = self.model
            if model is None or model.session_id != session_id:
                return  # the log keeps its record: a session known after a restart is harmless
            self._close_model()

    def _close_model(self) -> None:
        """Close the model's run (its files stay) and forget what the request log kept for it."""
        self.host.close()
        (self.directory / "model.json").unlink(missing_ok=True)
        self.model = None
        self.samplers = Samplers()  # its sampling clients end with it
        sessions = [{"kind": "session", "session_id": s} for s in sorted(self.sessions)]
        self.log.compact(lambda _: sessions)

    # -- the model -----------------------------------------------------------------------------

    def create_model(self, body: dict[str, Any]) -> str:
        """Open the server's one run for this model; its request id resolves at once."""
        session_id = get_str(body, "session_id", "") or ""
        self.require_session(session_id)
        config = config_of(body)
        model_dir = resolve_under(self.host.model_root, config.model, "base_model")
        if not model_dir.is_dir():
            raise NotFound(f"create_model: no model {config.model!r} under the model root")
        model_id = f"{session_id}:train:{get_int(body, 'model_seq_id', 0)}"
        with self._lock:
            if self.model is not None and self.model.model_id != model_id:
                if not self._lapsed(self.model.session_id):
                    raise FailedPrecondition(
                        f"this server already trains model {self.model.model_id!r} (one server, "
                        "one model): close that ServiceClient first, or start another server (a "
                        f"model whose client sends nothing for {SESSION_LAPSE_S:.0f} s is closed "
                        "when another asks)"
                    )
                logger.warning(
                    "Tinker front: model %s closed: its client sent nothing for %.0f s",
                    self.model.model_id,
                    SESSION_LAPSE_S,
                )
                self._close_model()
            tokenizer_id = self.tokenizer_id or str(model_dir)
            record = ModelRecord.new(model_id, session_id, config, tokenizer_id)
            self.host.open(record.run_id, config)
            record.save(self.directory)
            self.model = record
        self._seen[session_id] = time.monotonic()  # loading the model took a while
        return self._resolve_create(model_id)

    def _resolve_create(self, model_id: str) -> str:
        self.order.start_model(model_id)
        request_id = f"{model_id}/create"
        self.futures.add(request_id)
        self.futures.resolve(request_id, Done({"model_id": model_id, "type": "create_model"}))
        return request_id

    def require_model(self, model_id: str) -> ModelRecord:
        model = self.model
        if model is None or model.model_id != model_id:
            raise NotFound(f"no model {model_id!r} on this server; create_model first")
        return model

    # -- sequenced calls -----------------------------------------------------------------------

    def submit(
        self,
        route: str,
        body: dict[str, Any] | bytes,
        model_id: str,
        seq_id: Any,
        prepare: Callable[[], Callable[[str], Any]],
        *,
        encoding: str | None = None,
        keyed: bool = True,
    ) -> str:
        """Queue ``prepare()``'s call as ``seq_id`` of ``model_id``; its request id, once the
        request is durable in the log. A ``keyed`` call's success is the journal's to keep;
        every other outcome is logged before a poll sees it. ``prepare`` checks the request: if
        it refuses it, the refusal is raised (HTTP 400) and still takes the seq_id, answered as
        that failure to a poll or a re-send, so the calls numbered after it are not held."""
        self.require_model(model_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 1:
            raise InvalidArgument(f"seq_id must be an integer >= 1, got {seq_id!r}")
        request_id = f"{model_id}/{seq_id}"
        recorded = self._replayed.get(request_id) if self._replayed is not None else None
        try:
            call, refusal = prepare(), None
        except USER_ERRORS as error:
            call, refusal = None, error

        def job() -> None:
            if recorded is not None:
                self.futures.resolve(request_id, recorded)
                return
            if call is None:
                self._finish(request_id, Failed(str(refusal), "user"), durable=False)
                return
            outcome = self._run(lambda: call(request_id))
            # Encoding the response (and logging it) happens behind: the next call runs now.
            self._finisher.submit(self._encode_and_finish, request_id, outcome, keyed)

        payload_digest = digest(body)
        with self._lock:
            if not self.order.accepts(model_id, seq_id, payload_digest):
                return request_id  # a re-send: its future already exists
            ticket = self._record(call_record(route, request_id, seq_id, body, encoding))
            self.futures.add(request_id)
            self.order.submit(model_id, seq_id, payload_digest, job)
        if ticket is not None:
            self.log.sync(ticket)
        if refusal is not None:
            raise refusal
        return request_id

    def _run(self, call: Callable[[], Any]) -> Outcome:
        if self._cannot_replay:
            return Failed(self._cannot_replay, "server")
        return run_to_outcome(call)

    def compact_at(self, seq_id: int, position: int) -> None:
        """After checkpoint ``seq_id`` (journal ``position``): drop the records a restart no
        longer needs, if every call before it has been answered to the SDK."""
        with self._lock:
            head = [{"kind": "session", "session_id": s} for s in sorted(self.sessions)]
            head += self.samplers.records()
            head.append({"kind": "resume", "next_seq": seq_id, "position": position})
            self.log.compact(
                lambda records: compacted(records, seq_id, self.futures.delivered, head)
            )

    # -- sampling ------------------------------------------------------------------------------

    def model_name(self) -> str:
        return self.model.base_model if self.model is not None else ""

    def record(self, record: dict[str, Any]) -> None:
        """Write a record durably, ordered with the calls submitted around it."""
        with self._lock:
            self.log.write(record)

    def submit_unordered(
        self, request_id: str, body: dict[str, Any], call: Callable[[], Any]
    ) -> bool:
        """Queue ``call`` outside any model's sequence (a sample) as ``request_id``, once the
        request is durable; False for a re-send (its future already exists)."""
        recorded = self._replayed.get(request_id) if self._replayed is not None else None

        def job() -> None:
            if recorded is not None:
                self.futures.resolve(request_id, recorded)
            else:
                self._finish(request_id, self._run(call), durable=False)

        with self._lock:
            if self.futures.known(request_id):
                return False
            if self._replayed is None:  # a restart takes back all it accepted before
                self.order.check_room()
            ticket = self._record({"kind": "sample", "request_id": request_id, "body": body})
            self.futures.add(request_id)
            self.order.run_unordered(job)
        if ticket is not None:
            self.log.sync(ticket)
        return True
