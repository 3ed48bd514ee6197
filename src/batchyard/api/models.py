"""``GET /v1/models``: the catalog, its prices and what each route can do (``service.models``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from batchyard.api.context import Caller, ServiceDep
from batchyard.api.openapi import ModelList, ModelObject, declare
from batchyard.service import models

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/models", summary="The catalog")
@declare(ModelList)
async def list_models(principal: Caller, svc: ServiceDep) -> JSONResponse:
    data = await models.list_views(svc, principal)
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id}")
@declare(ModelObject)
async def get_model(principal: Caller, model_id: str, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await models.get(svc, principal, model_id))
