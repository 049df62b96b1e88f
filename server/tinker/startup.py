"""Starting and stopping the Tinker front: build its parts, read the request store back, and let
the calls run once the host has restored its run.

A restarted front reads its log before its listener serves (``replay``): sessions, samplers and
where a compacted log resumes come back first, then every call without a recorded result is
submitted again to its route in its original order (one with a result is answered with it). The
calls wait until the host's recovery is done (``Intake.recovered``). A record that fails to be
submitted again, whatever the error, fails that request alone (``Intake.replay_failed``): one
bad record never keeps the front, and so the server, from starting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainwire.server.service.host import SessionHost
from trainwire.server.service.intake import Intake
from trainwire.server.service.request_records import (
    CallRecord,
    NoteRecord,
    Record,
    ResumeRecord,
    SampleRecord,
    SessionRecord,
)
from trainwire.server.tinker import external_weights, sampling_routes, training_routes
from trainwire.server.tinker.catalog import Catalog
from trainwire.server.tinker.front import FRONT_DIR, TinkerFront
from trainwire.server.tinker.model_slot import ModelSlot
from trainwire.server.tinker.sdk_sessions import session_of

logger = logging.getLogger(__name__)

# The routes a logged training call is submitted to again, by the name its record holds.
ROUTES: dict[str, Callable[..., Any]] = {
    "forward_backward": training_routes.forward_backward,
    "optim_step": training_routes.optim_step,
    "save_weights": training_routes.save_weights,
    "load_weights": training_routes.load_weights,
    "save_weights_for_sampler": sampling_routes.save_weights_for_sampler,
    "save_weights_external": external_weights.save_weights_external,
}


def start_front(
    host: SessionHost,
    state_dir: Path,
    *,
    model_root: Path | None,
    tokenizer_id: str | None = None,
) -> TinkerFront:
    """The front of ``host``, its files in ``state_dir/tinker``, with its request store replayed."""
    directory = Path(state_dir) / FRONT_DIR
    intake = Intake(directory, host.order, owner_of=session_of, noun="model")
    external_weights.clean_encrypted_leftovers(directory)
    catalog = Catalog(directory)
    models = ModelSlot(
        host,
        intake,
        directory,
        model_root=model_root,
        tokenizer_id=tokenizer_id,
        catalog=catalog,
    )
    front = TinkerFront(host, intake, models, directory, model_root, catalog)
    replay(front)
    threading.Thread(
        target=_await_recovery, args=(front,), name="tinker-recover", daemon=True
    ).start()
    return front


def stop_front(front: TinkerFront) -> None:
    front.intake.stop()


def replay(front: TinkerFront) -> None:
    """Rebuild sessions, samplers and futures from the log; submit every unanswered call."""
    with front.intake.replaying() as records:
        for record in records:
            _take_back(front, record)


def _take_back(front: TinkerFront, record: Record) -> None:
    if isinstance(record, SessionRecord):
        front.models.sessions.add(record.session_id)
    elif isinstance(record, NoteRecord):
        front.sampling_sessions.restore(record)
    elif isinstance(record, ResumeRecord) and front.models.model is not None:
        front.intake.resume_at(front.models.model.model_id, record)
    elif isinstance(record, CallRecord | SampleRecord):
        _resubmit(front, record)


def _resubmit(front: TinkerFront, record: CallRecord | SampleRecord) -> None:
    front.intake.resubmitted(record.request_id)
    try:
        if isinstance(record, SampleRecord):
            sampling_routes.asample(front, record.body)
            return
        args = (record.body,) if record.encoding is None else (record.body, record.encoding)
        ROUTES[record.route](front, *args)
    except Exception as error:  # refused again, its model closed, or a record it cannot take
        if front.intake.replay_failed(record, error):
            logger.warning("Tinker front: %s failed on replay: %r", record.request_id, error)
        else:
            logger.info("Tinker front: %s refused again: %s", record.request_id, error)


def _await_recovery(front: TinkerFront) -> None:
    """Let submitted calls run once the host restored its run (at once when none)."""
    front.host.recover()  # queued behind serve()'s own recovery: returns once it is done
    front.intake.recovered(front.host.position)
