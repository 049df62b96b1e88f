"""The SDK's REST calls on training runs and checkpoints (``RestClient``), as plain functions over
the catalog: list and get runs (with their ``user_metadata``: the cookbook reads its renderer's
name there), list, delete and set the TTL of checkpoints, and a checkpoint's ``weights_info``.

Lists are bounded (``MAX_PAGE``) and paginated as the SDK asks (``limit``, ``offset``). Every
call first deletes what passed its TTL, so nothing expired is ever listed or loaded.
"""

from __future__ import annotations

from typing import Any

from trainwire.server.errors import InvalidArgument
from trainwire.server.tinker import saved_checkpoints
from trainwire.server.tinker.catalog import TinkerPath, check_ttl
from trainwire.server.tinker.front import TinkerFront

MAX_PAGE = 1000  # runs or checkpoints per answer


def page_bounds(limit: Any, offset: Any) -> tuple[int, int]:
    """``limit`` and ``offset`` as the query gave them (strings), checked."""
    try:
        limit_n, offset_n = int(limit), int(offset)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"limit and offset must be integers, got {limit!r}, {offset!r}"
        ) from None
    if not (1 <= limit_n <= MAX_PAGE and offset_n >= 0):
        raise InvalidArgument(f"need 1 <= limit <= {MAX_PAGE} and offset >= 0")
    return limit_n, offset_n


def list_training_runs(front: TinkerFront, limit: Any, offset: Any) -> dict[str, Any]:
    saved_checkpoints.sweep(front)
    limit_n, offset_n = page_bounds(limit, offset)
    runs = front.catalog.runs()
    page = runs[offset_n : offset_n + limit_n]
    return {
        "training_runs": [run.to_sdk() for run in page],
        "cursor": {"offset": offset_n, "limit": limit_n, "total_count": len(runs)},
    }


def get_training_run(front: TinkerFront, model_id: str) -> dict[str, Any]:
    saved_checkpoints.sweep(front)
    return front.catalog.run(model_id).to_sdk()


def list_checkpoints(front: TinkerFront, model_id: str) -> dict[str, Any]:
    saved_checkpoints.sweep(front)
    checkpoints = front.catalog.checkpoints(model_id)[-MAX_PAGE:]
    return {"checkpoints": [c.to_sdk(model_id) for c in checkpoints]}


def list_user_checkpoints(front: TinkerFront, limit: Any, offset: Any) -> dict[str, Any]:
    """Every run's checkpoints, newest first."""
    saved_checkpoints.sweep(front)
    limit_n, offset_n = page_bounds(limit, offset)
    every = [
        (saved.created_s, saved.to_sdk(run.model_id))
        for run in front.catalog.runs()
        for saved in front.catalog.checkpoints(run.model_id)
    ]
    every.sort(key=lambda item: -item[0])
    page = [sdk for _, sdk in every[offset_n : offset_n + limit_n]]
    cursor = {"offset": offset_n, "limit": limit_n, "total_count": len(every)}
    return {"checkpoints": page, "cursor": cursor}


def checkpoint_path(model_id: str, checkpoint_id: str) -> TinkerPath:
    """The path of ``checkpoint_id`` (``<kind>/<name>``) of run ``model_id``."""
    return TinkerPath.parse(f"tinker://{model_id}/{checkpoint_id}")


def delete_checkpoint(front: TinkerFront, model_id: str, checkpoint_id: str) -> None:
    saved_checkpoints.delete(front, checkpoint_path(model_id, checkpoint_id))


def set_checkpoint_ttl(
    front: TinkerFront, model_id: str, checkpoint_id: str, body: dict[str, Any]
) -> None:
    ttl = check_ttl(body.get("ttl_seconds"), "set_checkpoint_ttl")
    front.catalog.set_ttl(checkpoint_path(model_id, checkpoint_id), ttl)


def weights_info(front: TinkerFront, body: dict[str, Any]) -> dict[str, Any]:
    """The SDK's ``WeightsInfoResponse``: what a new run from this checkpoint would be."""
    saved_checkpoints.sweep(front)
    record, _ = front.catalog.find(TinkerPath.parse(body.get("tinker_path")))
    return {
        "base_model": record.base_model,
        "is_lora": record.lora_rank is not None,
        "lora_rank": record.lora_rank,
        **{name: value for name, value in record.switches.items()},
    }
