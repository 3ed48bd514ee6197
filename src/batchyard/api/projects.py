"""Projects and their datasets: ``/v1/projects`` and ``…/datasets``.

A dataset is created empty (a JSON body) or from a JSONL, CSV or Parquet upload
sent as the raw body. An upload streams to a temporary file and is parsed and
inserted in batches, so a large file never sits in memory whole; one that fails
part-way leaves no dataset behind. An upload is fingerprinted for its
Idempotency-Key by a hash of its bytes, and its rows obey the same strict JSON as
request bodies (a ``NaN`` is refused with the line it is on).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import csv
import hashlib
import json
import tempfile
from collections.abc import Iterator
from typing import IO, Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Connection

from batchyard.api.bodies import DatasetBody, ProjectBody, RowPatchBody
from batchyard.api.context import (
    Caller,
    ServiceDep,
    camel_page,
    idempotent,
    path_id,
    query_cursor,
    query_limit,
    read_json,
)
from batchyard.api.context import row_id as parse_row_id
from batchyard.api.openapi import ListOf, declare
from batchyard.core.clock import isoformat
from batchyard.core.inputs import check_document, parse_json, strict
from batchyard.core.runs import prompt_messages
from batchyard.errors import BatchyardError, InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from batchyard.store import projects as store
from batchyard.store import row_versions

__all__ = ["ProjectId", "dataset_json", "router"]

router = APIRouter()
ProjectId = Annotated[str, path_id("project_id", "pp", "project", param="projectId")]
DatasetId = Annotated[str, path_id("dataset_id", "ds", "dataset", param="datasetId")]

KINDS = ("text", "chat-sft")
BATCH = 1000
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


def project_json(p: store.Project) -> dict[str, Any]:
    return {
        "id": p.id,
        "name": p.name,
        "createdAt": isoformat(p.created_at),
        "updatedAt": isoformat(p.updated_at),
    }


def dataset_json(d: store.Dataset) -> dict[str, Any]:
    return {
        "id": d.id,
        "projectId": d.project_id,
        "name": d.name,
        "kind": d.kind,
        "rowCount": d.row_count,
        "fields": list(d.fields),
        "sourceRunId": d.source_run_id,
        "createdAt": isoformat(d.created_at),
        "updatedAt": isoformat(d.updated_at),
    }


def row_json(r: store.Row) -> dict[str, Any]:
    return {"id": r.id, "version": r.version, "data": r.data, "updatedAt": isoformat(r.updated_at)}


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise InvalidRequest("name must be a string of 1 to 200 characters", param="name")
    return value.strip()


def _kind(value: str | None) -> str | None:
    if value is not None and value not in KINDS:
        raise InvalidRequest("kind must be text or chat-sft", param="kind")
    return value


@router.post("/v1/projects", status_code=201)
@declare(body=ProjectBody)
async def create_project(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    body = await read_json(request)
    name = _name(strict(ProjectBody, body).name)

    async def handler() -> tuple[int, Any]:
        now = svc.clock.now()
        project = await svc.db.transact(
            lambda c: store.create_project(c, principal.org_id, name, now)
        )
        return 201, project_json(project)

    return await idempotent(request, principal, body, handler)


@router.get("/v1/projects/{project_id}")
async def get_project(principal: Caller, project_id: ProjectId, svc: ServiceDep) -> JSONResponse:
    project = await svc.db.read(lambda c: store.get_project(c, principal.org_id, project_id))
    return JSONResponse(project_json(project))


# -- uploads ---------------------------------------------------------------------


def _check_row(row: Any, kind: str, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise InvalidRequest(
            f"{where}: each row must be a JSON object", code="invalid_dataset_file"
        )
    if kind == "chat-sft" and prompt_messages(row, {"type": "messages"}) is None:
        raise InvalidRequest(
            f"{where}: a chat-sft row needs `messages`, a list of {{role, content}} objects",
            code="invalid_dataset_file",
        )
    return row


def _jsonl(f: IO[bytes]) -> Iterator[tuple[str, Any]]:
    for n, line in enumerate(f, 1):
        if line.strip():
            yield f"line {n}", parse_json(line, f"line {n}")


def _csv(f: IO[bytes]) -> Iterator[tuple[str, Any]]:
    text = codecs.getreader("utf-8-sig")(f)
    try:
        for n, record in enumerate(csv.DictReader(text), 2):
            row = {k: v for k, v in record.items() if k is not None}
            yield f"line {n}", check_document(row, f"line {n}")
    except (csv.Error, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the CSV file is not valid: {exc}") from None


def _parquet(f: IO[bytes]) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(f).iter_batches(batch_size=BATCH)
        for n, row in enumerate((row for b in batches for row in b.to_pylist()), 1):
            # Timestamps, decimals and bytes become strings: rows are JSON,
            # and strict JSON (a float NaN is refused, not stored).
            yield f"row {n}", parse_json(json.dumps(row, default=str), f"row {n}")
    except (pa.ArrowException, OSError) as exc:
        raise InvalidRequest(f"the Parquet file is not valid: {exc}") from None


def _file_rows(fmt: str, f: IO[bytes]) -> Iterator[tuple[str, Any]]:
    """The upload's rows, each where it is; anything wrong with the file is its 400."""
    try:
        yield from {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet}[fmt](f)
    except BatchyardError as exc:
        raise InvalidRequest(exc.message, code="invalid_dataset_file") from None


def _import(
    svc: Any, f: IO[bytes], fmt: str, org_id: str, project_id: str, name: str, kind: str | None
) -> store.Dataset:
    """Parse the spooled upload and insert it in batches (runs on a thread)."""
    rows = _file_rows(fmt, f)
    first = next(rows, None)
    if first is None:
        raise InvalidRequest("the uploaded file holds no rows", code="invalid_dataset_file")
    if kind is None:
        kind = "chat-sft" if isinstance(first[1], dict) and "messages" in first[1] else "text"
    now = svc.clock.now()
    ds = svc.db.transact_sync(
        lambda c: store.create_dataset(c, org_id, project_id, name, kind, now, ready=False)
    )
    try:
        batch = [_check_row(first[1], kind, first[0])]
        for where, row in rows:
            batch.append(_check_row(row, kind, where))
            if len(batch) >= BATCH:
                svc.db.transact_sync(lambda c, b=batch: store.append_rows(c, ds.id, b, now))
                batch = []

        def last(c: Connection) -> store.Dataset:
            store.append_rows(c, ds.id, batch, now)
            store.mark_ready(c, ds.id, now)
            return store.get_dataset(c, org_id, ds.id)

        done: store.Dataset = svc.db.transact_sync(last)
        return done
    except BaseException:
        # Best effort: if the store cannot even delete (disk full), the dataset stays
        # invisible (not ready) and the run worker's housekeeping purges it later.
        with contextlib.suppress(Exception):
            svc.db.transact_sync(lambda c: store.delete_dataset(c, ds.id))
        raise


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
    if fmt not in ("json", "jsonl", "csv", "parquet"):
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
    org = principal.org_id
    await svc.db.read(lambda c: store.get_project(c, org, project_id))
    fmt = _format(request)
    if fmt == "json":
        body = await read_json(request)
        shape = strict(DatasetBody, body)
        name, kind = _name(shape.name), _kind(shape.kind) or "text"

        async def create() -> tuple[int, Any]:
            now = svc.clock.now()
            ds = await svc.db.transact(
                lambda c: store.create_dataset(c, org, project_id, name, kind, now)
            )
            return 201, dataset_json(ds)

        return await idempotent(request, principal, body, create)
    name = _name(request.query_params.get("name"))
    kind_param = _kind(request.query_params.get("kind"))
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

        async def upload() -> tuple[int, Any]:
            loop = asyncio.get_running_loop()
            ds = await loop.run_in_executor(
                None, _import, svc, f, fmt, org, project_id, name, kind_param
            )
            return 201, dataset_json(ds)

        # The fingerprint of an upload: its bytes (hashed) and what the query asked.
        what = {"sha256": digest.hexdigest(), "name": name, "kind": kind_param, "format": fmt}
        return await idempotent(request, principal, what, upload)


@router.get("/v1/projects/{project_id}/datasets/{dataset_id}")
async def get_dataset(
    principal: Caller, project_id: ProjectId, dataset_id: DatasetId, svc: ServiceDep
) -> JSONResponse:
    ds = await svc.db.read(lambda c: store.get_dataset(c, principal.org_id, dataset_id, project_id))
    return JSONResponse(dataset_json(ds))


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

    def tx(c: Connection) -> list[store.Row]:
        store.get_dataset(c, principal.org_id, dataset_id, project_id)
        return store.list_rows(c, dataset_id, after=after, limit=limit + 1)

    rows = await svc.db.read(tx)
    return JSONResponse(camel_page([row_json(r) for r in rows], limit, lambda r: str(r["id"])))


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
    if not changes:
        raise InvalidRequest("data must be an object of the fields to change", param="data")

    async def handler() -> tuple[int, Any]:
        now = svc.clock.now()

        def tx(c: Connection) -> store.Row:
            ds = store.get_dataset(c, principal.org_id, dataset_id, project_id)
            if ds.kind == "chat-sft":
                merged = {**store.get_row(c, dataset_id, rid).data, **changes}
                _check_row(merged, ds.kind, "data")
            return row_versions.patch_row(c, dataset_id, rid, changes, now)

        return 200, row_json(await svc.db.transact(tx))

    return await idempotent(request, principal, body, handler)
