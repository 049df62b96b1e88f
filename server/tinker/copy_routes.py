"""``copy_weights``: a checkpoint copied into a new training run, exactly once by its key.

The SDK sends each copy with an ``X-Idempotency-Key`` (its retries send the same one). The copy's
model id follows from the caller's tenant and that key (or from the ``session_id`` and
``model_seq_id`` it names), so a retry, also after a restart, finds the copy it made and answers
its path; the same key with another request is refused (``AlreadyExists``, 400: the SDK does
not retry it). Each step is
written so that doing it again changes nothing (the files, the run's owner, its catalog record,
its checkpoint's record): a copy killed midway is finished by its retry.

The copy is a closed run (``SessionHost.copy_saved``): its files share the source's storage
(hard links), it is never trained on, and its checkpoint is listed, loaded, sampled, started from,
downloaded and deleted as any run's. The source may be the caller's own checkpoint or one
published on this server. This server has no projects: a ``destination_project_id`` is kept in
the copy's metadata (``copied_to_project``) and changes nothing else.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import replace
from typing import Any

from trainwire.contract.config import TrainingConfig
from trainwire.server.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from trainwire.server.service.state_dir import RunSpec
from trainwire.server.tinker.catalog import (
    SavedCheckpoint,
    TinkerPath,
    TrainingRunRecord,
    check_ttl,
)
from trainwire.server.tinker.fields import get_int, get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.tenancy import caller, session_id_named

COPY_SESSION_MARK = "copy"  # a copy made for a project holds a session id of its own: tw-copy…
FOLDERS = {"weights": "checkpoints", "sampler_weights": "exports", "external_weights": "exports"}


def copy_weights(front: TinkerFront, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    """The SDK's ``CopyWeightsResponse`` for ``body`` sent under idempotency ``key``."""
    path = TinkerPath.parse(get_str(body, "source_path"))
    ttl = check_ttl(body.get("ttl_seconds"), "copy_weights")
    if body.get("weights_access_token"):
        raise InvalidArgument(
            "copy_weights: weights_access_token reads another account's weights on the hosted "
            "service; on this server a checkpoint is readable when it is yours or published"
        )
    tenant = caller()
    key = key or uuid.uuid4().hex  # without a key, each call is a copy of its own
    digest = hashlib.sha256(json.dumps([tenant, body], sort_keys=True).encode()).hexdigest()
    model_id, project = _destination(front, body, tenant, key)
    copied = TinkerPath(model_id, path.segment, path.name)
    with front.catalog.removal_guard:  # the source is not removed while its files are linked
        source, saved = front.catalog.find(path)
        held = front.catalog.held(model_id)
        if held is not None and held.copy_key != key:
            raise FailedPrecondition(
                f"model {model_id!r} holds a run already: copy into a model_seq_id not used yet"
            )
        if held is not None and held.copy_digest != digest:
            raise AlreadyExists(
                f"copy_weights: idempotency key {key!r} was used for another copy; send a new key"
            )
        config = TrainingConfig.from_dict(source.config)
        spec = RunSpec(run_id_for(model_id), source.config, config.fingerprint(), None, "")
        front.host.copy_saved(source.run_id, spec, FOLDERS[path.segment], saved.stored_as)
    if front.models.owners is not None and tenant is not None:
        front.models.owners.claim(spec.run_id, tenant)
    now = time.time()
    metadata = {"copied_from": str(path), **({"copied_to_project": project} if project else {})}
    record = _copy_record(source, model_id, metadata, now, key, digest)
    front.catalog.add_run(record)
    expires = None if ttl is None else now + ttl
    copy = SavedCheckpoint(
        copied.checkpoint_id, saved.stored_as, now, saved.size_bytes, expires, f"copy:{key}"
    )
    front.catalog.add_checkpoint(copied, copy)  # a retry keeps the first record (``saved_by``)
    return {"tinker_path": str(copied)}


def _destination(
    front: TinkerFront, body: dict[str, Any], tenant: str | None, key: str
) -> tuple[str, str]:
    """The copy's model id, and the project it names ("" for none)."""
    session_id = get_str(body, "session_id")
    project = get_str(body, "destination_project_id") or ""
    if session_id:
        front.models.require_session(session_id)
        seq = get_int(body, "model_seq_id")
        if seq is None or seq < 0:
            raise InvalidArgument("copy_weights: give model_seq_id (>= 0) with session_id")
        return f"{session_id}:train:{seq}", project
    if not project:
        raise InvalidArgument(
            "copy_weights: give destination_project_id, or session_id and model_seq_id"
        )
    name = hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()[:16]
    return f"{session_id_named(COPY_SESSION_MARK + name, tenant)}:train:0", project


def _copy_record(
    source: TrainingRunRecord,
    model_id: str,
    metadata: dict[str, str],
    now: float,
    key: str,
    digest: str,
) -> TrainingRunRecord:
    """The copy's run: the source run's model and configuration, none of its checkpoints."""
    return replace(
        source,
        model_id=model_id,
        user_metadata=metadata,
        created_s=now,
        last_request_s=now,
        checkpoints={},
        deferred=[],
        copy_key=key,
        copy_digest=digest,
    )
