"""``GET /v1/models``: the catalog with its prices (seed 000's "Pricing").

Each model is an OpenAI model object (``id``, ``object``, ``created``,
``owned_by``) with batchyard's own fields beside: its prices, its
``capabilities`` (chat, tools, vision, streaming, completions, embeddings,
scoring: what its route can do here, so a client can tell before it asks),
and ``concurrency``, how many calls its route runs at once (the embedded
model's contexts), which a runner should not exceed however high its tier.

Fine-tuned versions also show their warm state (``warm``: cold, loading or
warm, until when, and how long the last load took), so a caller can warm one
before a long run; base models are always served and show ``warm: null``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from batchyard.api.context import authenticate, json_response, service_of
from batchyard.core.catalog import ModelSpec
from batchyard.core.money import format_money
from batchyard.errors import ModelNotFound, ModelUnavailable
from batchyard.service import Service
from batchyard.work.warmth import serving

__all__ = ["model_json", "router", "warm_json"]

router = APIRouter()


def warm_json(svc: Service, m: ModelSpec) -> dict[str, Any] | None:
    if m.type != "version":
        return None
    try:
        where = serving(svc.catalog, m)
    except ModelUnavailable:
        return None
    return svc.warmth.view(m.id, where).to_json()


def capabilities(svc: Service, m: ModelSpec) -> dict[str, bool]:
    routes = svc.catalog.routes_for(m.id)
    route = routes[0] if routes else None
    return {
        "chat": route is not None,
        "tools": bool(route and route.tools),
        "vision": m.reads_images and route is not None,
        "streaming": bool(route and route.supports_streaming),
        "completions": bool(route and route.serves_completions),
        "embeddings": bool(route and route.embeddings),
        "scoring": bool(route and svc.dispatcher.can_score(route)),
    }


def route_concurrency(svc: Service, m: ModelSpec) -> int | None:
    routes = svc.catalog.routes_for(m.id)
    if not routes:
        return None
    return svc.dispatcher.concurrency(routes[0])


def model_json(
    m: ModelSpec,
    available: bool,
    warm: dict[str, Any] | None = None,
    svc: Service | None = None,
) -> dict[str, Any]:
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
        "available": available,
        "warm": warm,
        "description": m.description,
        **(
            {"capabilities": capabilities(svc, m), "concurrency": route_concurrency(svc, m)}
            if svc is not None
            else {}
        ),
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    await authenticate(request)
    svc = service_of(request)
    data = [
        model_json(m, svc.catalog.is_available(m.id), warm_json(svc, m), svc)
        for m in svc.catalog.models.values()
    ]
    return json_response({"object": "list", "data": data})


@router.get("/v1/models/{model_id}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    await authenticate(request)
    svc = service_of(request)
    m = svc.catalog.models.get(model_id)
    if m is None:
        raise ModelNotFound(f"the model {model_id!r} does not exist", param="model")
    return json_response(model_json(m, svc.catalog.is_available(m.id), warm_json(svc, m), svc))
