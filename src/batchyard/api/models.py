"""``/v1/models``: the catalog (``service.models``), and the model versions uploaded into a project.

``GET /v1/models`` lists the catalog, its prices and what each route can do.
``/v1/projects/{projectId}/models`` holds LoRA adapters and full weights: the
file part streams to disk beside the accepted versions and is checked whole
before anything is kept (``service.model_versions``): a refused upload leaves
neither a file nor a row.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import IO, Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from batchyard.api.context import Caller, ServiceDep, allow_query, path_id, read_upload
from batchyard.api.openapi import ListOf, ModelList, ModelObject, declare
from batchyard.api.projects import ProjectId
from batchyard.core.accounts import Principal
from batchyard.errors import InvalidRequest
from batchyard.service import model_versions as versions
from batchyard.service import models

__all__ = ["router"]

router = APIRouter()

_PATH = "/v1/projects/{project_id}/models"
_FIELDS = ("base", "type", "name")


VersionId = Annotated[str, path_id("version_id", "mv", "model version", code="model_not_found")]


@router.get("/v1/models", summary="The catalog")
@declare(ModelList)
async def list_models(principal: Caller, svc: ServiceDep) -> JSONResponse:
    data = await models.list_views(svc, principal)
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id}")
@declare(ModelObject)
async def get_model(principal: Caller, model_id: str, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await models.get(svc, principal, model_id))


@router.post(
    _PATH,
    status_code=201,
    summary="Upload a model version (multipart/form-data: file, base, type, name)",
)
@declare(
    multipart={
        "type": "object",
        "required": ["file", "base", "type"],
        "properties": {
            "file": {"type": "string", "format": "binary"},
            "base": {"type": "string"},
            "type": {"type": "string", "enum": ["lora", "weights"]},
            "name": {"type": "string"},
        },
    }
)
async def upload_version(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> JSONResponse:
    allow_query(request)
    spool = versions.spool(versions.folder_of(svc))
    made: list[IO[bytes]] = []

    def make() -> IO[bytes]:
        f = spool()
        made.append(f)
        return f

    try:
        upload = await read_upload(request, _FIELDS, versions.settings_of(svc).max_bytes, make)
    except BaseException:
        for f in made:
            versions.discard_spool(f)
        raise
    try:
        if upload.file is None:
            raise InvalidRequest("the upload has no file part", param="file")
        upload.file.close()
        view: dict[str, Any] = await asyncio.to_thread(
            versions.take_in,
            svc,
            principal,
            project_id,
            Path(upload.file.name),
            upload.size,
            fields=upload.fields,
            filename=upload.filename,
        )
    finally:
        # Accepted, the file was renamed away; refused, it is still here to remove.
        for f in made:
            versions.discard_spool(f)
    return JSONResponse(view, 201)


@router.get(_PATH, summary="The project's model versions")
@declare(ListOf)
async def list_versions(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> JSONResponse:
    allow_query(request)
    data = await versions.list_views(svc, principal, project_id)
    return JSONResponse({"object": "list", "data": data})


async def _version(
    request: Request, principal: Caller, project_id: ProjectId, version_id: VersionId
) -> tuple[Principal, str, str]:
    allow_query(request)
    return principal, project_id, version_id


#: The caller and the version its path names (a show or a delete takes no query).
Version = Annotated[tuple[Principal, str, str], Depends(_version)]


@router.get(_PATH + "/{version_id}")
async def get_version(version: Version, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await versions.get(svc, *version))


@router.delete(_PATH + "/{version_id}")
async def delete_version(version: Version, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await versions.delete(svc, *version))
