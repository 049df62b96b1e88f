"""Publishing a checkpoint (the SDK's ``publish_checkpoint_from_tinker_path`` and
``unpublish_...``): on a self-hosted server, "published" means readable by every tenant of this
server.

A published checkpoint is loaded, sampled, started from and downloaded by any tenant; it stays
its owner's: only the owner publishes or unpublishes it, deletes it, or lists it and its run.
The flag lives in the catalog beside the checkpoint, so it outlives a restart, and goes with the
checkpoint when it is deleted or expires. Publishing twice (or unpublishing a private one)
changes nothing and succeeds: a retried call whose first answer was lost must not fail.
Unpublishing is refused (409) while another tenant's load of it is one a restart replays
(``saved_checkpoints.unpublish``).
"""

from __future__ import annotations

from fastapi import FastAPI, Response
from starlette.concurrency import run_in_threadpool

from trainwire.server.tinker import saved_checkpoints
from trainwire.server.tinker.checkpoint_routes import checkpoint_path
from trainwire.server.tinker.front import TinkerFront

API = "/api/v1"
PUBLISH_ROUTE = f"{API}/training_runs/{{model_id}}/checkpoints/{{kind}}/{{name}}/publish"


def set_published(front: TinkerFront, model_id: str, checkpoint_id: str, public: bool) -> None:
    """Publish or unpublish checkpoint ``checkpoint_id`` (``<kind>/<name>``) of ``model_id``;
    NotFound for one that is not there or is another tenant's."""
    saved_checkpoints.sweep(front)  # one past its TTL is gone, not published
    path = checkpoint_path(model_id, checkpoint_id)
    if public:
        front.catalog.set_public(path, True)
    else:
        saved_checkpoints.unpublish(front, path)  # refused while another tenant's replay reads it


def register(app: FastAPI, front: TinkerFront) -> None:
    """The publish routes: POST publishes, DELETE unpublishes (204 either way)."""

    @app.post(PUBLISH_ROUTE)
    async def publish(model_id: str, kind: str, name: str) -> Response:
        await run_in_threadpool(set_published, front, model_id, f"{kind}/{name}", True)
        return Response(status_code=204)

    @app.delete(PUBLISH_ROUTE)
    async def unpublish(model_id: str, kind: str, name: str) -> Response:
        await run_in_threadpool(set_published, front, model_id, f"{kind}/{name}", False)
        return Response(status_code=204)
