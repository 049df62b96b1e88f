"""The table of the SDK's models: which run each model is, and the SDK sessions that may use
them.

Each ``create_model`` opens a run of the host for its model (``ModelRecord`` keeps what
``get_info`` answers, across restarts); closing the ServiceClient that created it closes its
runs (their files stay) and ends their sampling sessions. A server of one run (``--max-runs 1``)
holds one model: a model whose client sent nothing for ``SESSION_LAPSE_S`` (three missed
heartbeats: the script died) gives way to another client's ``create_model`` instead of holding
the server until a restart. A server of many runs holds up to ``--max-runs`` models side by side,
of any client; when they fill it, a run opened only to sample a closed run's saved weights gives
its slot to a new model, then the model whose client has been silent longest, once past
``SESSION_LAPSE_S`` (a model restored at a restart counts from the restart, so one from before
``--tenants`` goes the same way). With none silent, the new model is refused (429, which the SDK
retries) until one closes or lapses.

A call belongs to the run it was sent to (``TinkerFront.submit`` names it in the call's command):
the host runs it only while that run is open, and fails it with nothing applied once its model
was closed, never on another model's run (closing a run is a job of the engine thread too, so it
comes between two calls, never inside one).

A model's run may also be closed through the other port (a gRPC ``Close``: ``trainwire close``).
The host is not told about the front (calls go one way), so the front asks it: a model whose run
the host closed is closed here too, answered as a model closed through the SDK (404), listed
nowhere, and never resumed at a restart (``forget_closed``, run at start, before each new model
and when a session finishes).

Sessions are not kept forever: one silent for ``SESSION_KEEP_S`` with nothing of its own still asked
for (no open model, no future left to fetch) is forgotten everywhere (``forget_lapsed``): the known
sessions, its futures, its sampling sessions and its records in the request store (deleted at once).
A session its client closed goes the same way, without waiting for the lapse. A heartbeat, or any
request naming the session (its models' and sampling sessions' calls included), keeps it. A
forgotten session's heartbeat and calls are refused 404 with the reason: the SDK keeps heartbeating
and warns with it, where a 410 would stop its heartbeats silently. Lapsed sessions are looked for
before each compaction, and on ``create_session`` at most every ``SWEEP_EVERY_S`` (new sessions are
what makes them pile up).

State changes come before the records that log them, so a compaction that reads this state (see
``Intake.compact_at``) never drops a record of something it does not also keep.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from functools import partial
from pathlib import Path
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.contract.outcomes import OperationSpec
from trainwire.server.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from trainwire.server.paths import resolve_under
from trainwire.server.service import operations as ops
from trainwire.server.service.host import SessionHost
from trainwire.server.service.intake import Intake
from trainwire.server.service.request_records import Record, SessionRecord
from trainwire.server.service.requests import CheckpointRequest
from trainwire.server.service.results import Done
from trainwire.server.service.run_owners import RunOwners
from trainwire.server.service.tenants import Tenants
from trainwire.server.tinker.catalog import Catalog
from trainwire.server.tinker.fields import get_int, get_str
from trainwire.server.tinker.model import (
    ModelRecord,
    fit_lora_roles,
    fit_max_length,
    training_config,
)
from trainwire.server.tinker.sampling_sessions import SamplingSessions
from trainwire.server.tinker.sdk_sessions import SDK_HEARTBEAT_S, SdkSessions, session_of
from trainwire.server.tinker.start_from import (
    START_CHECKPOINT,
    StartFrom,
    lora_switches,
    run_record,
)
from trainwire.server.tinker.tenancy import caller, new_session_id, tenant_of, visible

logger = logging.getLogger(__name__)

# A client silent for three heartbeats gives up its model to another client's create_model: a
# script that exited without closing is usually run again at once.
SESSION_LAPSE_S = 3 * SDK_HEARTBEAT_S
# A session silent for 60 heartbeats, with nothing of its own still asked for, is forgotten. The
# SDK itself warns after 120 s of failed heartbeats that its session will be terminated; five
# times that rides out what it still calls an unreliable connection (or a paused client), while
# the sessions of scripts that crashed do not pile up in memory and in the request store.
SESSION_KEEP_S = 60 * SDK_HEARTBEAT_S
SWEEP_EVERY_S = 6 * SDK_HEARTBEAT_S  # create_session looks for lapsed sessions at most this often
SAMPLING_RUN_PREFIX = "tinker-sampling-"  # a run opened only to sample saved sampler weights
# How long a sample's turn waits for the model table before refusing (``open_for_sampling``):
# longer than any bookkeeping under it takes, far shorter than a client's patience.
TABLE_WAIT_ON_ENGINE_S = 2.0


class ModelTable:
    """The open models (by model id), the SDK sessions that may use them and the sampling
    sessions (``sampling_sessions``)."""

    def __init__(
        self,
        host: SessionHost,
        intake: Intake,
        directory: Path,
        *,
        model_root: Path | None,
        tokenizer_id: str | None,
        catalog: Catalog,
        tenants: Tenants | None = None,
        owners: RunOwners | None = None,
    ) -> None:
        self.host = host
        self.tenants = tenants  # their max_runs
        self.owners = owners  # who holds each run id, across both transports
        self.intake = intake
        self.catalog = catalog
        self.directory = directory
        self.model_root = model_root
        self.tokenizer_id = tokenizer_id
        self.sampling_sessions = SamplingSessions()
        self.sessions = SdkSessions()  # a test may give its ``clock``
        self._swept_at = -math.inf  # when lapsed sessions were last looked for (sessions' clock)
        self._lock = threading.Lock()  # the models; one create_model or close at a time
        self._models: dict[str, ModelRecord] = {}  # the open models, by model id
        self._sampling_run: dict[str, str] = {}  # config fingerprint → its sampling run
        for record in ModelRecord.load_all(directory):
            self._add_model(record)
            self.sessions.add(record.session_id)
            self._resolve_create(record.model_id)
        intake.admit = self._admit
        intake.before_compaction = self.forget_lapsed

    @property
    def many(self) -> bool:
        """Whether models train side by side here (``--max-runs`` above 1)."""
        return self.host.max_runs > 1

    # -- sessions ------------------------------------------------------------------------------

    def create_session(self) -> str:
        if self.sessions.clock() - self._swept_at >= SWEEP_EVERY_S:
            self.forget_lapsed()
        session_id = new_session_id(caller())
        self.sessions.add(session_id)
        self.intake.record(SessionRecord(session_id))
        return session_id

    def require_session(self, session_id: str) -> None:
        """NotFound for a session this server does not know (or another tenant's); a known one
        counts as alive."""
        if not visible(session_id) or not self.sessions.heard_from(session_id):
            raise NotFound(unknown_session(session_id))

    def _admit(self, request_id: str) -> None:
        """A request is taken only for a session still known, and keeps it alive."""
        self.require_session(session_of(request_id))

    def session_records(self) -> list[Record]:
        """What a compacted request store starts with: the sessions known (lapsed ones were
        forgotten before it, ``Intake.before_compaction``)."""
        return [SessionRecord(session_id) for session_id in self.sessions]

    def head_records(self) -> list[Record]:
        """What a restart must know before any request: the sessions, then the samplers."""
        return [*self.session_records(), *self.sampling_sessions.records()]

    def _lapsed(self, session_id: str) -> bool:
        """No request and no heartbeat for SESSION_LAPSE_S; after a restart, counted from it."""
        return self.sessions.silent_for(session_id) > SESSION_LAPSE_S

    def forget_lapsed(self) -> None:
        """Forget every session silent for more than ``SESSION_KEEP_S`` with nothing of its own
        still asked for: none with an open model, and none with a future left to fetch (a
        pending sample of one of its sampling sessions included)."""
        self._swept_at = self.sessions.clock()
        training = {model.session_id for model in self.open_models()}
        silent = self.sessions.silent(SESSION_KEEP_S) - training
        if silent:
            silent -= self.intake.results.unfetched_owners(session_of)
        # Checked again as they go: a session heard from meanwhile (a create_model, a sample) stays.
        self._forget(silent, silent_s=SESSION_KEEP_S)

    def _forget(self, session_ids: set[str], *, silent_s: float = -math.inf) -> None:
        """Forget ``session_ids`` everywhere (those still silent for ``silent_s``), and with them
        whatever is left of a session no longer known."""
        gone = self.sessions.forget(session_ids, silent_s=silent_s)
        self.sampling_sessions.forget(
            lambda sampling_id: session_of(sampling_id) not in self.sessions
        )
        self.intake.forget_sessions(gone, self.sessions.__contains__)
        if gone:
            logger.info("Tinker front: %d SDK session(s) forgotten: %s", len(gone), sorted(gone))

    def finish_session(self, session_id: str) -> None:
        """The SDK closed its ServiceClient: its models' runs close (new ones may be created),
        and the session is forgotten once nothing of its own is left to fetch (its calls still
        queued answer that their model was closed)."""
        self.require_session(session_id)
        with self._lock:
            self._forget_closed()
            self.sessions.close(session_id)
            own = self.models_of(session_id)
            for model in own:
                self._close_model(model)  # its compaction looks for lapsed sessions first
            if not own:
                self.forget_lapsed()

    # -- the models ----------------------------------------------------------------------------

    def create_model(self, body: dict[str, Any]) -> str:
        """Open a run for this model; its request id resolves at once."""
        session_id = get_str(body, "session_id", "") or ""
        self.require_session(session_id)
        config, model_dir = self._fitted(training_config(body), "create_model")
        model_id = f"{session_id}:train:{get_int(body, 'model_seq_id', 0)}"
        listed = run_record(model_id, config, lora_switches(body), body)  # checked before opening
        with self._lock:
            self._forget_closed()  # a model closed through the gRPC port holds no slot either
            if model_id in self._models:
                return self._resolve_create(model_id)  # a retry of a finished create
            self._make_room(session_id)
            tokenizer_id = self.tokenizer_id or str(model_dir)
            record = ModelRecord.new(model_id, session_id, config, tokenizer_id)
            admit = partial(self._claim, record.run_id, tenant_of(session_id))
            self.host.open(record.run_id, config, admit=admit)
            self.catalog.add_run(listed)
            record.save(self.directory)
            self._add_model(record)
        self.sessions.heard_from(session_id)  # loading the model took a while
        return self._resolve_create(model_id)

    def create_from_state(self, body: dict[str, Any]) -> str:
        """A new model started from a saved training checkpoint of any run (the SDK's
        ``create_training_client_from_state[_with_optimizer]``): its weights with a fresh
        optimizer, or (``optimizer``) its whole continuation state under the same configuration.

        The run opens with the saved run's configuration, loads the checkpoint and saves its own
        first checkpoint (``START_CHECKPOINT``) before the answer: a restart restores that, so the
        start is never lost, and a retried request finds each step journaled."""
        session_id = get_str(body, "session_id", "") or ""
        self.require_session(session_id)
        start = StartFrom.of(body, self.catalog)
        config = start.config(self.model_root)
        model_id = f"{session_id}:train:{get_int(body, 'model_seq_id', 0)}"
        listed = run_record(model_id, config, start.source.switches, body)  # checked first
        with self._lock:
            self._forget_closed()  # a model closed through the gRPC port holds no slot either
            if model_id in self._models:
                return self._resolve_from_state(model_id, start)  # a retry of a finished create
            self._make_room(session_id)
            model_dir = resolve_under(self.model_root, config.model, "base_model")
            record = ModelRecord.new(
                model_id, session_id, config, self.tokenizer_id or str(model_dir)
            )
            admit = partial(self._claim, record.run_id, tenant_of(session_id))
            self.host.open(record.run_id, config, admit=admit)
            try:
                start.apply(self.host, model_id, record.run_id)
                first = CheckpointRequest(START_CHECKPOINT)
                key = OperationSpec(f"{model_id}/start")
                self.host.apply(ops.SAVE_STATE, first, key, run_id=record.run_id)
            except Exception:
                self.host.close(record.run_id)  # refused or failed: no model, nothing open
                raise
            self.catalog.add_run(listed)
            record.save(self.directory)
            self._add_model(record)
        self.sessions.heard_from(session_id)
        return self._resolve_from_state(model_id, start)

    def _resolve_from_state(self, model_id: str, start: StartFrom) -> str:
        self.intake.start_stream(model_id, run_id=self._models[model_id].run_id)
        request_id = f"{model_id}/create"
        outcome = {"type": "load_weights", "path": str(start.path), "model_id": model_id}
        self.intake.resolve_now(request_id, Done(outcome))
        return request_id

    def _make_room(self, asking: str) -> None:
        """Before a new model of session ``asking`` opens (under ``_lock``): on a server of one
        run, the open model gives way if its client went silent (``_give_way``); on any server,
        runs opened only for sampling close when the new model needs their slot."""
        if not self.many:
            for model in self.open_models():
                self._give_way(model, asking)
            self._end_sampling_runs()
            return
        if self._full():
            self._end_sampling_runs()
        if self._full():
            self._give_way_to(asking)

    def _full(self) -> bool:
        """Every run slot of this server of many runs is taken."""
        return len(self.host.open_run_ids) >= self.host.max_runs

    def _give_way_to(self, asking: str) -> None:
        """On a full server of many runs, close the model whose client has been silent longest
        (past ``SESSION_LAPSE_S``) for session ``asking``'s new model; ResourceExhausted (429,
        which the SDK retries), closing nothing, while every model's client is alive. A tenant
        at its own ``max_runs`` is refused first: no model is closed for a create that would
        then be refused."""
        if self.owners is not None:
            self._check_run_limit(tenant_of(asking))
        lapsed = [m for m in self.open_models() if self._lapsed(m.session_id)]
        if not lapsed:
            raise ResourceExhausted(
                f"every run slot of this server is taken (--max-runs {self.host.max_runs}); a "
                f"model whose client has sent nothing for {SESSION_LAPSE_S:.0f} s (a script "
                "that exited without closing) gives way to a new one, else close a model "
                "(ServiceClient, or trainwire close) or use another server"
            )
        oldest = max(lapsed, key=lambda m: (self.sessions.silent_for(m.session_id), m.model_id))
        logger.warning(
            "Tinker front: model %s closed for a new model: its client sent nothing for %.0f s",
            oldest.model_id,
            self.sessions.silent_for(oldest.session_id),
        )
        self._close_model(oldest)

    def _give_way(self, model: ModelRecord, asking: str) -> None:
        """Close ``model`` for session ``asking``'s new one, if its own client went silent.

        The same client asking for a second model is refused at once (400: waiting cannot
        help). Another client is told to retry (503, which the SDK retries for minutes): the
        usual case is a script that exited or was killed without closing its ServiceClient and
        is run again, and its model gives way once its heartbeats have stopped for
        ``SESSION_LAPSE_S``."""
        if model.session_id == asking:
            raise FailedPrecondition(
                f"this client already trains model {model.model_id!r} here (one server, one "
                "model): close it first, or start another server (or one with --max-runs)"
            )
        if not self._lapsed(model.session_id):
            raise Unavailable(  # naming no model: the other client may be another tenant's
                f"this server trains a model of another client (one server, one model); it "
                f"gives way once that client has sent nothing for "
                f"{SESSION_LAPSE_S:.0f} s (a script that exited without closing), else close "
                "that ServiceClient or start another server"
            )
        logger.warning(
            "Tinker front: model %s closed: its client sent nothing for %.0f s",
            model.model_id,
            SESSION_LAPSE_S,
        )
        self._close_model(model)

    def open_for_sampling(self, config: TrainingConfig, tenant: str) -> str:
        """A run of ``config`` (a closed run's) to sample its saved sampler weights on, for
        ``tenant``; its run id. A sampling run of another config is closed first; a new model
        closes it. On a server of one run, FailedPrecondition while a model is open (its own
        run samples); on a server of many, ResourceExhausted while every slot is taken.

        It runs at a sample's turn, on the engine thread, where a create_model or a close may
        hold the table while it waits for that very thread to open or close its run: it waits
        for the table ``TABLE_WAIT_ON_ENGINE_S`` at most, then refuses the sample (Unavailable:
        sent again, it samples on the model just created, or opens its run then)."""
        if not self._lock.acquire(timeout=TABLE_WAIT_ON_ENGINE_S):
            raise Unavailable(
                "a model is being created or closed on this server while this sample was to "
                "open a run of its model to sample on; sample again"
            )
        try:
            return self._open_for_sampling(config, tenant)
        finally:
            self._lock.release()

    def _open_for_sampling(self, config: TrainingConfig, tenant: str) -> str:
        """``open_for_sampling``, under ``_lock``."""
        models = self.open_models()
        if not self.many and models:
            model = models[0]
            raise FailedPrecondition(
                f"this server trains {model.base_model!r} now (one server, one model)"
            )
        run_id = self._sampling_run.get(config.fingerprint())
        if run_id is not None and run_id in self.host.open_run_ids:
            return run_id
        self._end_sampling_runs()
        if self.many and len(self.host.open_run_ids) >= self.host.max_runs:
            raise ResourceExhausted(
                f"every run slot of this server is taken (--max-runs {self.host.max_runs}): "
                "these sampler weights are sampled once a model closes"
            )
        run_id = f"{SAMPLING_RUN_PREFIX}{uuid.uuid4().hex[:16]}"
        self.host.open(run_id, config, admit=partial(self._claim, run_id, tenant, training=False))
        self._sampling_run = {config.fingerprint(): run_id}
        return run_id

    def _claim(self, run_id: str, tenant: str, *, training: bool = True) -> None:
        """A run of ``tenant``'s admission, run by the host atomically with the open
        (``SessionHost.open``'s ``admit``: no gRPC Open lands between this count and the open):
        on a server of one run, a run another tenant opened (over gRPC) is refused without
        naming it; a training run counts against the tenant's ``max_runs``; and ``run_id``
        becomes the tenant's (``RunOwners``)."""
        if self.owners is None:
            return
        held = self._held_runs()
        if not self.many and any(not self.owners.holds(r, tenant) for r in held):
            raise FailedPrecondition(
                "another client's run is open on this server (one server, one model): "
                "create yours once it has closed, or use another server"
            )
        if training:
            self._check_run_limit(tenant)
        self.owners.claim(run_id, tenant)

    def _held_runs(self) -> list[str]:
        """The open runs that train (a model's or a gRPC client's), not those opened only to
        sample saved weights."""
        return [r for r in self.host.open_run_ids if not r.startswith(SAMPLING_RUN_PREFIX)]

    def _check_run_limit(self, tenant: str) -> None:
        """The tenant's ``max_runs``, counted over the training runs it holds open (with
        ``owners``)."""
        if self.owners is not None and self.tenants is not None and tenant in self.tenants:
            own = sum(1 for r in self._held_runs() if self.owners.holds(r, tenant))
            self.tenants.check_run_limit(tenant, own)

    def _end_sampling_runs(self) -> None:
        """Close the runs opened only for sampling (also those a restart restored): a model's
        run takes their place. Other runs (a gRPC client's) are left alone."""
        for run_id in self.host.open_run_ids:
            if run_id.startswith(SAMPLING_RUN_PREFIX):
                self.host.close(run_id)
        self._sampling_run = {}

    def _add_model(self, record: ModelRecord) -> None:
        self._models[record.model_id] = record

    def _close_model(self, model: ModelRecord) -> None:
        """Close ``model``'s run (its files stay) and forget the model (``_forget_model``).
        Under ``_lock``."""
        self._forget_model(model, close_run=True)

    def forget_closed(self) -> None:
        """Forget every model whose run the host closed through another port (a gRPC Close),
        as closing it here would have: at start, once the stored calls were submitted again, so a
        closed run's model is not resumed (nor its calls held for a position it never
        reaches)."""
        with self._lock:
            self._forget_closed()

    def _forget_closed(self) -> None:
        """``forget_closed``, under ``_lock``."""
        for model in list(self._models.values()):
            if self.host.was_closed(model.run_id):
                logger.info("Tinker front: model %s closed through the gRPC port", model.model_id)
                self._forget_model(model, close_run=False)

    def _forget_model(self, model: ModelRecord, *, close_run: bool) -> None:
        """Close ``model``'s run (``close_run``; else it is closed already) and forget the model
        and what the request store kept for it: its record, its sampling sessions and its
        stream; its calls still queued fail when their turn comes (their run is not open).
        Under ``_lock``."""
        if close_run:
            self.host.close(model.run_id)
        model.remove(self.directory)
        del self._models[model.model_id]
        self.sampling_sessions.end_model(model.model_id)  # its sampling clients end with it
        self.intake.end_stream(model.model_id)
        self.intake.forget_stream(model.model_id, self.head_records)

    def _resolve_create(self, model_id: str) -> str:
        self.intake.start_stream(model_id, run_id=self._models[model_id].run_id)
        request_id = f"{model_id}/create"
        self.intake.resolve_now(request_id, Done({"model_id": model_id, "type": "create_model"}))
        return request_id

    def require_model(self, model_id: str) -> ModelRecord:
        """The open model ``model_id``; NotFound for one not known, another tenant's, or one
        whose run was closed (here or through the gRPC port: the same answer)."""
        model = self._models.get(model_id)
        if model is None or not visible(model_id) or self.host.was_closed(model.run_id):
            raise NotFound(f"no model {model_id!r} on this server; create_model first")
        return model

    def open_models(self) -> list[ModelRecord]:
        """The open models, by model id (none whose run was closed through the gRPC port)."""
        models = [m for m in self._models.values() if not self.host.was_closed(m.run_id)]
        return sorted(models, key=lambda model: model.model_id)

    def models_of(self, session_id: str) -> list[ModelRecord]:
        """The open models ``session_id`` created."""
        return [model for model in self.open_models() if model.session_id == session_id]

    def by_run(self, run_id: str) -> ModelRecord | None:
        """The open model whose run is ``run_id`` (None: no open model's)."""
        return next((m for m in self.open_models() if m.run_id == run_id), None)

    def position_of(self, model_id: str) -> int:
        """Where the run of model ``model_id`` is (0 when it is not open)."""
        model = self._models.get(model_id)
        return 0 if model is None else self.host.position_of(model.run_id)

    def base_sampling_config(self, base_model: str) -> TrainingConfig:
        """The config of a run opened only to sample ``base_model`` (``open_for_sampling``):
        the smallest LoRA run of it, whose adapter a base-model sample leaves out, so its
        samples are those of any open model of that base."""
        config = training_config({"base_model": base_model, "lora_config": {"rank": 1}})
        return self._fitted(config, "sample")[0]

    def _fitted(self, config: TrainingConfig, call: str) -> tuple[TrainingConfig, Path]:
        """``config`` fitted to its base model under the model root, and that model's
        directory: ``max_length`` at most its positions (the engine refuses more than it
        holds), the LoRA switches as its layers."""
        model_dir = self.base_model_dir(config.model, call)
        return fit_lora_roles(fit_max_length(config, model_dir), model_dir), model_dir

    def base_model_dir(self, name: str, call: str) -> Path:
        """Base model ``name``'s directory under the model root; NotFound, naming ``call``,
        where there is none."""
        model_dir = resolve_under(self.model_root, name, "base_model")
        if not model_dir.is_dir():
            raise NotFound(f"{call}: no model {name!r} under the model root")
        return model_dir

    def model_name(self) -> str:
        """The base model this server's open models train ("" with none open)."""
        models = self.open_models()
        return models[0].base_model if models else ""


def unknown_session(session_id: str) -> str:
    """Why a session is not known, and what to do (a client paused past the lapse reads this)."""
    return (
        f"no session {session_id!r} on this server: never created here, closed, or forgotten "
        f"after {SESSION_KEEP_S:.0f} s without a heartbeat; create a new ServiceClient"
    )
