"""``copy_weights``: a checkpoint copied into a new training run, exactly once by its key.

The SDK sends each copy with an ``X-Idempotency-Key`` (its retries send the same one). The copy's
model id follows from the caller's tenant and that key (or from the ``session_id`` and
``model_seq_id`` it names), so a retry, also after a restart, finds the copy it made and answers
its path; the same key with another request is refused (``AlreadyExists``, 400: the SDK does
not retry it).

The copy is a closed run (``SessionHost.copy_saved``): its files share the source's storage
(hard links), it is never trained on, and its checkpoint is listed, loaded, sampled, started from,
downloaded and deleted as any run's. The source may be the caller's own checkpoint or one
published on this server; the copy is the caller's. It offers what its source offers: a copy of
encrypted external weights holds only their encrypted files (``copy_encrypted``). This server
has no projects: a ``destination_project_id`` is kept in the copy's metadata
(``copied_to_project``) and changes nothing else.

The steps run in an order that keeps tenants and stores apart: the run id is claimed for the
caller first (``RunOwners``: a run written first reads as ``default``'s), then the files are
written (each whole or not at all), then one catalog record holds the run and its checkpoint.
The record is the answer: a retry that finds it answers at once; a copy that fails before it
undoes every step it made (files, run, claim), so nothing is left on disk or in a listing.
A copy killed before its record is finished by its retry.
"""

from __future__ import annotations

import hashlib
import json
import shutil
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
from trainwire.server.tinker.external_weights import copy_encrypted
from trainwire.server.tinker.fields import get_int, get_str
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.model import run_id_for
from trainwire.server.tinker.saved_checkpoints import encrypted_dir
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
        held = front.catalog.run_of_any_tenant(model_id)
        if held is not None:
            _check_retry(held, model_id, key, digest)
            return {"tinker_path": str(copied)}
        source, saved = front.catalog.find(path)
        config = TrainingConfig.from_dict(source.config)
        spec = RunSpec(run_id_for(model_id), source.config, config.fingerprint(), None, "")
        now = time.time()
        metadata = {"copied_from": str(path), **({"copied_to_project": project} if project else {})}
        expires = None if ttl is None else now + ttl
        copy = SavedCheckpoint(
            copied.checkpoint_id, saved.stored_as, now, saved.size_bytes, expires, f"copy:{key}"
        )
        record = _copy_record(source, model_id, metadata, now, key, digest, copy)
        _claim(front, spec.run_id, tenant)
        written = False
        try:
            sealed = copy_encrypted(front, path, copied)
            stored = None if sealed else saved.stored_as  # encrypted: no plaintext in the copy
            front.host.copy_saved(source.run_id, spec, FOLDERS[path.segment], stored)
            written = True
            front.catalog.add_run(record)
        except BaseException:
            _undo_copy(front, copied, spec.run_id, tenant, written=written)
            raise
    return {"tinker_path": str(copied)}


def _check_retry(held: TrainingRunRecord, model_id: str, key: str, digest: str) -> None:
    """A run recorded under the copy's model id answers a retry of the same copy; another
    request is refused, naming what to send instead."""
    if held.copy_key != key:
        raise FailedPrecondition(
            f"model {model_id!r} holds a run already: copy into a model_seq_id not used yet"
        )
    if held.copy_digest != digest:
        raise AlreadyExists(
            f"copy_weights: idempotency key {key!r} was used for another copy; send a new key"
        )


def _claim(front: TinkerFront, run_id: str, tenant: str | None) -> None:
    """Make the copy's run id the caller's before anything is written under it."""
    if front.models.owners is not None and tenant is not None:
        front.models.owners.claim(run_id, tenant)


def _undo_copy(
    front: TinkerFront, copied: TinkerPath, run_id: str, tenant: str | None, *, written: bool
) -> None:
    """Undo a copy that failed before its record: nobody was answered with it. Its run (when
    written here or by a try a crash cut short), its encrypted files and its claim go."""
    if written:
        front.host.discard_copy(run_id)
    shutil.rmtree(encrypted_dir(front, copied), ignore_errors=True)
    if front.models.owners is not None and tenant is not None:
        front.models.owners.release(run_id, tenant)  # kept while a run of that id is on disk


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
    copy: SavedCheckpoint,
) -> TrainingRunRecord:
    """The copy's run: the source run's model and configuration, and the copied checkpoint as
    its only one (one record, written in one step)."""
    return replace(
        source,
        model_id=model_id,
        user_metadata=metadata,
        created_s=now,
        last_request_s=now,
        checkpoints={copy.checkpoint_id: copy},
        deferred=[],
        copy_key=key,
        copy_digest=digest,
    )
