"""``GET /v1/models``: the catalog with its prices (seed 000's "Pricing").

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
from batchyard.errors import ModelUnavailable, NotFound
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


def model_json(m: ModelSpec, available: bool, warm: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": m.id,
        "object": "model",
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
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    await authenticate(request)
    svc = service_of(request)
    data = [
        model_json(m, svc.catalog.is_available(m.id), warm_json(svc, m))
        for m in svc.catalog.models.values()
    ]
    return json_response({"object": "list", "data": data})


@router.get("/v1/models/{model_id}")
async def get_model(request: Request, model_id: str) -> JSONResponse:
    await authenticate(request)
    svc = service_of(request)
    m = svc.catalog.models.get(model_id)
    if m is None:
        raise NotFound(f"model {model_id!r} not found")
    return json_response(model_json(m, svc.catalog.is_available(m.id), warm_json(svc, m)))
