"""Starting and stopping the Tinker front: build its parts, give the intake its routes, read
the front's own state back, and let the calls run once the host has restored its run.

A restarted front takes its own state back from the request store before its listener serves
(``replay``): sessions, samplers and where a compacted store resumes. Then the intake submits
every stored request without a recorded result again, to the route that took it, in its
original order (``Intake.replay``); the calls wait until the host's recovery is done
(``Intake.recovered``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from trainwire.server.service.host import SessionHost
from trainwire.server.service.intake import UNORDERED_ROUTE, Intake
from trainwire.server.service.request_records import (
    NoteRecord,
    Record,
    ResumeRecord,
    SessionRecord,
)
from trainwire.server.service.run_owners import RunOwners
from trainwire.server.service.tenants import Tenants
from trainwire.server.tinker import (
    external_weights,
    sampling_routes,
    saved_checkpoints,
    saves_applied,
    training_routes,
)
from trainwire.server.tinker.catalog import Catalog
from trainwire.server.tinker.front import FRONT_DIR, TinkerFront
from trainwire.server.tinker.model_table import ModelTable
from trainwire.server.tinker.sdk_sessions import session_of
from trainwire.server.tinker.tenancy import calling, sender_of, tenant_of

logger = logging.getLogger(__name__)

# The routes a stored request is given to again, by the name its record holds.
ROUTES: dict[str, Callable[..., Any]] = {
    "forward_backward": training_routes.forward_backward,
    "optim_step": training_routes.optim_step,
    "save_weights": training_routes.save_weights,
    "load_weights": training_routes.load_weights,
    "save_weights_for_sampler": sampling_routes.save_weights_for_sampler,
    "save_weights_external": external_weights.save_weights_external,
    UNORDERED_ROUTE: sampling_routes.asample,
}


def start_front(
    host: SessionHost,
    state_dir: Path,
    *,
    model_root: Path | None,
    tokenizer_id: str | None = None,
    tenants: Tenants | None = None,
    owners: RunOwners | None = None,
) -> TinkerFront:
    """The front of ``host``, its files in ``state_dir/tinker``, with its request store replayed
    (``tenants``' limits and the ``owners`` of run ids: ``ModelTable``)."""
    directory = Path(state_dir) / FRONT_DIR
    intake = Intake(host, owner_of=session_of, noun="model", account_of=tenant_of)
    external_weights.clean_encrypted_leftovers(directory)
    catalog = Catalog(directory)
    models = ModelTable(
        host,
        intake,
        directory,
        model_root=model_root,
        tokenizer_id=tokenizer_id,
        catalog=catalog,
        tenants=tenants,
        owners=owners,
    )
    front = TinkerFront(host, intake, models, directory, model_root, catalog)
    for name, route in ROUTES.items():
        intake.routes[name] = partial(_submit_again, route, front)
    intake.identities["save_weights_for_sampler"] = sampling_routes.snapshot_identity
    intake.applied = partial(saves_applied.applied, front)
    # Before the replay: a replayed load reads what it read, so no save may write over it.
    host.checkpoint_readers = partial(saved_checkpoints.checkpoint_readers, front)
    replay(front)
    threading.Thread(
        target=_await_recovery, args=(front,), name="tinker-recover", daemon=True
    ).start()
    return front


def stop_front(front: TinkerFront) -> None:
    front.intake.stop()


def replay(front: TinkerFront) -> None:
    """Restore the front's own state, then let the intake submit every unanswered request.
    A model whose run was closed through the gRPC port (and the server stopped before the front
    heard of it) is forgotten then, before the host's recovery is checked against the
    positions its stored calls were compacted at: a closed run is not resumed."""
    with front.intake.replaying() as records:
        for record in records:
            _restore_front_state(front, record)
        front.intake.replay(records)
    front.models.forget_closed()


def _restore_front_state(front: TinkerFront, record: Record) -> None:
    if isinstance(record, SessionRecord):
        front.models.sessions.add(record.session_id)
    elif isinstance(record, NoteRecord):
        front.sampling_sessions.restore(record)
    elif isinstance(record, ResumeRecord):
        models = {model.model_id: model.run_id for model in front.models.open_models()}
        if record.stream in models:
            front.intake.resume_at(record, run_id=models[record.stream])


def _submit_again(
    route: Callable[..., Any], front: TinkerFront, body: Any, encoding: str | None
) -> Any:
    """A stored request given to its route again, as the listener gave it the first time: as
    its tenant's, so what it was refused then (another tenant's checkpoint) it is refused now."""
    with calling(sender_of(body)):
        return route(front, body) if encoding is None else route(front, body, encoding)


def _await_recovery(front: TinkerFront) -> None:
    """Let submitted calls run once the host restored its runs (at once when none)."""
    front.host.recover()  # queued behind serve()'s own recovery: returns once it is done
    front.intake.recovered(front.models.position_of)
