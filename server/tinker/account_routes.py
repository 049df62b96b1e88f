"""The SDK's account calls: who the caller is, what this server serves, what the caller stores,
and the hosted service's billing, audit, JWT and key management, answered as a self-hosted server
can.

- ``auth/apikey/me`` (the CLI's ``tinker auth login``) names the caller's tenant and the kind of
  key, never the key; deleting a key is refused: keys are the server's configuration.
- ``auth/token`` is refused: this server issues no JWTs (``client/config`` says so), so the SDK
  keeps sending its key; ``RestClient.whoami``, which reads a JWT, is refused by the SDK itself.
- ``client/dynamic_config``: the SDK's defaults, with explicit sample cancellation on
  (``cancel_future``).
- ``get_server_capabilities``: the base models under the model root, and, beside the SDK's
  fields, the losses served (and refused, with why), that custom losses run on the client, the
  optimizer and the runs one server holds at once.
- Checkpoint storage: the bytes on disk under the caller's runs' checkpoints and exports.
- Billing: there is none, so the usage is an empty list. The audit log is a local record: the
  creation of each of the caller's live checkpoints (a deleted one leaves no entry).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, date, datetime
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from trainwire.server.errors import FailedPrecondition, InvalidArgument
from trainwire.server.service.capabilities import refused_losses, served_losses
from trainwire.server.tinker import saved_checkpoints
from trainwire.server.tinker.front import TinkerFront
from trainwire.server.tinker.model import supported_models
from trainwire.server.tinker.saved_checkpoints import folder_bytes
from trainwire.server.tinker.tenancy import caller

API = "/api/v1"
BYTES_PER_GIGABYTE = 1e9  # the storage billing unit the SDK reports in
AUDIT_EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")
# Where a custom loss runs: the front's client/config answers custom_loss_server_side false, so
# the SDK's forward_backward_custom computes it on the client from the logprobs it is sent.
CUSTOM_LOSS_RUNS_ON = "client"
NO_JWT = (
    "this server issues no JWTs (its client/config answers pjwt_auth_enabled false): the SDK "
    "sends its API key as X-API-Key on every call"
)
KEYS_ARE_CONFIGURATION = (
    "API keys are this server's configuration (--tinker-token, or a tenant's key in the "
    "--tenants file): revoke one by removing it there and restarting the server"
)


def tenant_name() -> str:
    """The caller's tenant (``default`` on a server with one key, or none)."""
    return caller() or "default"


def key_details(front: TinkerFront) -> dict[str, Any]:
    """The CLI's ``SelfApiKeyResponse``: the caller's tenant and its kind of key, never the key.
    ``key_id`` is derived from the tenant's name, so it is the same across restarts."""
    name, tenants = tenant_name(), front.models.tenants
    if caller() is None:
        note = "this server takes no key"
    elif tenants is None or len(tenants) == 1:
        note = "the server's one key"
    else:
        note = "a tenant's key (--tenants)"
    return {
        "key_id": int(hashlib.sha256(name.encode()).hexdigest()[:12], 16),
        "name": name,
        "note": note,
        "details": {"org_details": {"name": "trainwire"}, "user_details": {"email": ""}},
    }


def capabilities(front: TinkerFront) -> dict[str, Any]:
    """The SDK's ``GetServerCapabilitiesResponse`` (``supported_models``), and what else this
    server serves, for a reader of the JSON (the SDK ignores fields it does not know)."""
    return {
        "supported_models": supported_models(front.model_root),
        "loss_functions": served_losses(),
        "refused_loss_functions": refused_losses(),
        "custom_loss": CUSTOM_LOSS_RUNS_ON,
        "optimizers": ["adamw"],
        "max_runs": front.host.max_runs,
    }


def dynamic_config() -> dict[str, Any]:
    """The SDK's ``ClientDynamicConfigResponse``."""
    return {
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": True,  # cancel_future is served
        "sample_cancel_max_batch_size": 64,
    }


def refuse_projects(project_id: str | None, what: str) -> None:
    if project_id:
        raise InvalidArgument(
            f"{what}: project_id {project_id!r}: this server has no projects (what it stores "
            "belongs to tenants, one per key); ask without project_id"
        )


def storage_usage(front: TinkerFront, project_id: str | None) -> dict[str, Any]:
    """The SDK's ``CurrentCheckpointStorageUsageResponse`` for the caller: its live named
    checkpoints, and the bytes on disk under its runs' checkpoints and exports."""
    refuse_projects(project_id, "get_current_checkpoint_storage_usage")
    saved_checkpoints.sweep(front)
    runs = front.catalog.runs()
    count = sum(len(front.catalog.checkpoints(run.model_id)) for run in runs)
    size = 0
    for run in runs:
        folder = front.host.state_dir.run(run.run_id)
        size += folder_bytes(folder.checkpoints) + folder_bytes(folder.exports)
    item = {
        "project_id": None,
        "org_user_urn": tenant_name(),
        "user_email": None,
        "user_name": tenant_name(),
        "checkpoint_count": count,
        "size_bytes": size,
        "size_gigabytes": size / BYTES_PER_GIGABYTE,
        "estimated_monthly_cost_usd": None,
    }
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [item]}


def billing_usage(starting_on: str | None, ending_before: str | None) -> dict[str, Any]:
    """The SDK's ``BillingUsageResponse``: nothing is billed here, so no usage."""
    for name, value in (("starting_on", starting_on), ("ending_before", ending_before)):
        if not value:
            raise InvalidArgument(f"get_billing_usage: {name} is required (RFC 3339)")
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise InvalidArgument(f"get_billing_usage: {name} {value!r} is not RFC 3339") from None
    return {"data": [], "sessions": {}, "cost_data_through": None}


def audit_log(front: TinkerFront, event_type: str, day: str | None) -> dict[str, Any]:
    """The SDK's ``AuditLogResponse``: the creation of each of the caller's live checkpoints,
    oldest first (this server keeps no other audit record)."""
    if event_type not in AUDIT_EVENT_TYPES:
        raise InvalidArgument(f"get_audit_log: event_type is one of {', '.join(AUDIT_EVENT_TYPES)}")
    try:
        wanted = date.fromisoformat(day) if day else None
    except ValueError:
        raise InvalidArgument(f"get_audit_log: day {day!r} is not YYYY-MM-DD") from None
    if event_type not in ("all", "checkpoints"):
        return {"entries": []}
    saved_checkpoints.sweep(front)
    entries = []
    for run in front.catalog.runs():
        for saved in front.catalog.checkpoints(run.model_id):
            when = datetime.fromtimestamp(saved.created_s, UTC)
            if wanted is not None and when.date() != wanted:
                continue
            path = f"tinker://{run.model_id}/{saved.checkpoint_id}"
            details = {"tinker_path": path, "size_bytes": saved.size_bytes, "public": saved.public}
            entries.append(
                {
                    "timestamp": when.isoformat(),
                    "event": "checkpoint_create",
                    "event_details": details,
                    "model_id": run.model_id,
                    "tinker_path": path,
                }
            )
    return {"entries": sorted(entries, key=lambda entry: entry["timestamp"])}


def register(app: FastAPI, front: TinkerFront) -> None:
    """The account routes (``get_server_capabilities`` stays the app's, answering
    ``capabilities``)."""

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return dynamic_config()

    @app.post(f"{API}/auth/token")
    async def auth_token() -> None:
        raise FailedPrecondition(NO_JWT)

    @app.get(f"{API}/auth/apikey/me")
    async def api_key() -> dict[str, Any]:
        return key_details(front)

    @app.delete(f"{API}/auth/apikey/me")
    async def delete_api_key() -> None:
        raise FailedPrecondition(KEYS_ARE_CONFIGURATION)

    @app.get(f"{API}/billing/usage/checkpoints/current")
    async def checkpoint_storage(project_id: str | None = None) -> dict[str, Any]:
        return await run_in_threadpool(storage_usage, front, project_id)

    @app.get(f"{API}/billing/usage/events")
    async def billing_events(
        starting_on: str | None = None, ending_before: str | None = None
    ) -> dict[str, Any]:
        return billing_usage(starting_on, ending_before)

    @app.get(f"{API}/audit")
    async def audit(event_type: str = "all", day: str | None = None) -> dict[str, Any]:
        return await run_in_threadpool(audit_log, front, event_type, day)
