"""The catalog as ``GET /v1/models`` shows it: prices, and what each route can do here.

Each model is an OpenAI model object with batchyard's fields beside
(docs/reference/http.md): ``capabilities``, so a client can tell before it
asks; ``concurrency``, which a runner should not exceed however high its tier;
a version's ``warm`` state, so a caller can warm one before a long run; and
``loaded``, the engine's own word (``null`` where it cannot say: an upstream).
"""

from __future__ import annotations

from typing import Any

from batchyard.core.accounts import Principal
from batchyard.core.catalog import ModelSpec, RouteSpec
from batchyard.core.money import format_money
from batchyard.errors import BatchyardError, ModelNotFound, ModelUnavailable
from batchyard.service.deployment import Service
from batchyard.service.model_versions import org_versions, resolve
from batchyard.work.warmth import serving

__all__ = ["get", "list_views", "model_view"]


def _warm(svc: Service, m: ModelSpec) -> dict[str, Any] | None:
    if m.type != "version":
        return None
    try:
        where = serving(svc.catalog, m)
    except ModelUnavailable:
        return None
    return svc.warmth.view(m.id, where).to_json()


def _capabilities(svc: Service, m: ModelSpec, route: RouteSpec | None) -> dict[str, bool]:
    return {
        "chat": route is not None,
        "tools": bool(route and route.tools),
        "vision": m.reads_images and route is not None,
        "streaming": bool(route and route.supports_streaming),
        "completions": bool(route and route.serves_completions),
        # The embedded engine's embeddings come from the base model's own states, so
        # a version it serves has none of its own.
        "embeddings": bool(route and route.embeddings)
        and not (m.type == "version" and route is not None and route.engine == "llama_cpp"),
        "scoring": bool(route and svc.dispatcher.can_score(route)),
    }


def _loaded(svc: Service, m: ModelSpec, route: RouteSpec | None) -> bool | None:
    """Whether the engine holds the model in memory now; None where it cannot say."""
    if route is None:
        return False
    try:
        engine = svc.engines.for_route(route)
    except (BatchyardError, ValueError):
        return None
    is_loaded = getattr(engine, "is_loaded", None)
    if not callable(is_loaded):
        return None
    version = None if route.model == m.id else svc.catalog.engine_name(m.id, route)
    try:
        return bool(is_loaded(version))
    except KeyError:
        return None


def model_view(svc: Service, m: ModelSpec) -> dict[str, Any]:
    routes = svc.catalog.routes_for(m.id)
    route = routes[0] if routes else None
    return {
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": m.owned_by,
        "type": m.type,
        "base_model": m.base_model,
        "modality": list(m.modality),
        "context_window": m.context_window,
        "max_output_tokens": m.max_output_tokens,
        "pricing": {
            "input_per_mtok": format_money(m.input_per_mtok),
            "output_per_mtok": format_money(m.output_per_mtok),
        },
        "available": svc.catalog.is_available(m.id),
        "warm": _warm(svc, m),
        "description": m.description,
        "project_id": m.project_id,
        "capabilities": _capabilities(svc, m, route),
        "concurrency": None if route is None else svc.dispatcher.concurrency(route),
        "loaded": _loaded(svc, m, route),
    }


async def list_views(svc: Service, principal: Principal) -> list[dict[str, Any]]:
    """Every model the caller's organisation may call, its own versions included."""
    await org_versions(svc, principal.org_id)
    return [model_view(svc, m) for m in svc.catalog.visible(principal.org_id)]


async def get(svc: Service, principal: Principal, model_id: str) -> dict[str, Any]:
    await resolve(svc, model_id)
    m = svc.catalog.find(model_id, principal.org_id)
    if m is None:
        raise ModelNotFound(f"the model {model_id!r} does not exist", param="model")
    return model_view(svc, m)
