"""Projects and their datasets: ``/v1/projects`` and ``…/datasets`` (``service.datasets``).

A dataset is created empty (a JSON body) or from a JSONL, CSV or Parquet upload
sent as the raw body. An upload streams to a temporary file, refused as soon as
it passes the cap, and is fingerprinted for its Idempotency-Key by a hash of its
bytes.
"""

from __future__ import annotations

import hashlib
import tempfile
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from batchyard.api.bodies import DatasetBody, ProjectBody, RowPatchBody
from batchyard.api.context import (
    Caller,
    ServiceDep,
    camel_page,
    once,
    path_id,
    query_cursor,
    query_limit,
    read_json,
)
from batchyard.api.context import row_id as parse_row_id
from batchyard.api.openapi import ListOf, declare
from batchyard.core.inputs import strict
from batchyard.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from batchyard.service import datasets

__all__ = ["ProjectId", "router"]

router = APIRouter()
ProjectId = Annotated[str, path_id("project_id", "pp", "project", param="projectId")]
DatasetId = Annotated[str, path_id("dataset_id", "ds", "dataset", param="datasetId")]

_FORMATS = {
    "application/json": "json",
    "application/x-ndjson": "jsonl",
    "application/jsonl": "jsonl",
    "application/jsonlines": "jsonl",
    "application/x-jsonlines": "jsonl",
    "text/csv": "csv",
    "application/csv": "csv",
    "application/vnd.apache.parquet": "parquet",
    "application/x-parquet": "parquet",
    "application/parquet": "parquet",
}


@router.post("/v1/projects", status_code=201)
@declare(body=ProjectBody)
async def create_project(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    body = await read_json(request)
    name = datasets.check_name(strict(ProjectBody, body).name)
    return await once(
        request, principal, body, partial(datasets.create_project, svc, principal, name), status=201
    )


@router.get("/v1/projects/{project_id}")
async def get_project(principal: Caller, project_id: ProjectId, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await datasets.get_project(svc, principal, project_id))


def _format(request: Request) -> str:
    fmt = request.query_params.get("format")
    if fmt is None:
        header = request.headers.get("content-type")
        if header is None:
            raise UnsupportedMediaType(
                "send a JSON body {name, kind} with Content-Type: application/json, or a "
                "JSONL, CSV or Parquet file with its Content-Type",
                param="Content-Type",
            )
        fmt = _FORMATS.get(header.split(";")[0].strip().lower())
    if fmt not in datasets.FORMATS:
        raise InvalidRequest(
            "send a JSON body {name, kind} for an empty dataset, or a JSONL, CSV or Parquet "
            "file (Content-Type application/x-ndjson, text/csv or application/vnd.apache.parquet,"
            " or ?format=jsonl|csv|parquet)",
            param="Content-Type",
            code="unsupported_dataset_format",
        )
    return fmt


@router.post("/v1/projects/{project_id}/datasets", status_code=201)
@declare(
    body=DatasetBody,
    extra_body_types=("text/csv", "application/x-ndjson", "application/vnd.apache.parquet"),
)
async def create_dataset(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> Response:
    await datasets.get_project(svc, principal, project_id)
    fmt = _format(request)
    if fmt == "json":
        body = await read_json(request)
        shape = strict(DatasetBody, body)
        name = datasets.check_name(shape.name)
        kind = datasets.check_kind(shape.kind) or "text"
        create = partial(datasets.create_dataset, svc, principal, project_id, name, kind)
        return await once(request, principal, body, create, status=201)
    name = datasets.check_name(request.query_params.get("name"))
    asked = datasets.check_kind(request.query_params.get("kind"))
    cap = svc.settings.max_upload_bytes
    with tempfile.TemporaryFile(prefix="batchyard-upload-") as f:
        size = 0
        digest = hashlib.sha256()
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise PayloadTooLarge(f"the upload is over {cap} bytes")
            digest.update(chunk)
            f.write(chunk)
        f.seek(0)

        upload = partial(
            datasets.import_dataset, svc, principal, project_id, f, fmt=fmt, name=name, kind=asked
        )
        # The fingerprint of an upload: its bytes (hashed) and what the query asked.
        what = {"sha256": digest.hexdigest(), "name": name, "kind": asked, "format": fmt}
        return await once(request, principal, what, upload, status=201)


@router.get("/v1/projects/{project_id}/datasets/{dataset_id}")
async def get_dataset(
    principal: Caller, project_id: ProjectId, dataset_id: DatasetId, svc: ServiceDep
) -> JSONResponse:
    return JSONResponse(await datasets.get_dataset(svc, principal, project_id, dataset_id))


@router.get("/v1/projects/{project_id}/datasets/{dataset_id}/rows")
@declare(ListOf)
async def list_rows(
    request: Request,
    principal: Caller,
    project_id: ProjectId,
    dataset_id: DatasetId,
    svc: ServiceDep,
) -> JSONResponse:
    limit = query_limit(request, default=100, most=1000)
    after = query_cursor(request)
    rows = await datasets.list_rows(
        svc, principal, project_id, dataset_id, after=after, limit=limit + 1
    )
    return JSONResponse(camel_page(rows, limit, lambda r: str(r["id"])))


@router.patch("/v1/projects/{project_id}/datasets/{dataset_id}/rows/{row_id}")
@declare(body=RowPatchBody)
async def patch_row(
    request: Request,
    principal: Caller,
    project_id: ProjectId,
    dataset_id: DatasetId,
    row_id: str,
    svc: ServiceDep,
) -> Response:
    """Merge ``{"data": {...}}`` into a row as a new version; ``null`` removes a field."""
    rid = parse_row_id(row_id)
    body = await read_json(request)
    changes = strict(RowPatchBody, body).data
    patch = partial(datasets.patch_row, svc, principal, project_id, dataset_id, rid, changes)
    return await once(request, principal, body, patch)
