"""Projects and their datasets: ``/v1/projects`` and ``…/datasets``.

A dataset is created empty (a JSON body ``{"name", "kind"}``) or from an
upload of JSONL, CSV or Parquet sent as the raw request body (``?name=`` and
``?kind=`` in the query; the format from ``Content-Type`` or ``?format=``).
Uploads are streamed: the body goes to a temporary file chunk by chunk, then
it is parsed incrementally and inserted in batches, so a large file never sits
in memory whole. An upload that fails part-way leaves no dataset behind.

Every ID is checked against the caller's organisation; another
organisation's project, dataset or row is 404, never 403.
"""

from __future__ import annotations

import asyncio
import codecs
import csv
import json
import tempfile
from collections.abc import Iterator
from typing import IO, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Connection

from batchyard.api.context import authenticate, json_response, read_json, service_of
from batchyard.core.accounts import Scope
from batchyard.core.clock import isoformat
from batchyard.core.runs import prompt_messages
from batchyard.errors import InvalidRequest, NotFound, PayloadTooLarge
from batchyard.store import projects as store
from batchyard.store import row_versions

__all__ = ["dataset_json", "router"]

router = APIRouter()

READ = (Scope.FULL, Scope.READ, Scope.INFERENCE)
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


def _name(value: Any, param: str = "name") -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise InvalidRequest(f"{param} must be a string of 1 to 200 characters", param=param)
    return value.strip()


def _limit(request: Request, default: int = 100, most: int = 1000) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be an integer from 1 to {most}", param="limit")
    return int(raw)


@router.post("/v1/projects")
async def create_project(request: Request) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL)
    body = await read_json(request)
    name = _name(body.get("name"))
    svc = service_of(request)
    now = svc.clock.now()
    project = await svc.db.transact(lambda c: store.create_project(c, principal.org_id, name, now))
    return json_response(project_json(project), 201)


@router.get("/v1/projects/{project_id}")
async def get_project(request: Request, project_id: str) -> JSONResponse:
    principal = await authenticate(request, *READ)
    svc = service_of(request)
    project = await svc.db.read(lambda c: store.get_project(c, principal.org_id, project_id))
    return json_response(project_json(project))


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
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except ValueError as exc:
            raise InvalidRequest(
                f"line {n} is not valid JSON: {exc}", code="invalid_dataset_file"
            ) from None


def _csv(f: IO[bytes]) -> Iterator[tuple[str, Any]]:
    text = codecs.getreader("utf-8-sig")(f)
    try:
        for n, record in enumerate(csv.DictReader(text), 2):
            yield f"line {n}", {k: v for k, v in record.items() if k is not None}
    except (csv.Error, UnicodeDecodeError) as exc:
        raise InvalidRequest(
            f"the CSV file is not valid: {exc}", code="invalid_dataset_file"
        ) from None


def _parquet(f: IO[bytes]) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
        n = 0
        for batch in pf.iter_batches(batch_size=BATCH):
            for row in batch.to_pylist():
                n += 1
                # Timestamps, decimals and bytes become strings: rows are JSON.
                yield f"row {n}", json.loads(json.dumps(row, default=str))
    except (pa.ArrowException, OSError) as exc:
        raise InvalidRequest(
            f"the Parquet file is not valid: {exc}", code="invalid_dataset_file"
        ) from None


def _import(
    svc: Any, f: IO[bytes], fmt: str, org_id: str, project_id: str, name: str, kind: str | None
) -> store.Dataset:
    """Parse the spooled upload and insert it in batches (runs on a thread)."""
    reader = {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet}[fmt]
    rows = reader(f)
    first = next(rows, None)
    if first is None:
        raise InvalidRequest("the uploaded file holds no rows", code="invalid_dataset_file")
    if kind is None:
        kind = "chat-sft" if isinstance(first[1], dict) and "messages" in first[1] else "text"
    now = svc.clock.now()
    ds = svc.db.transact_sync(
        lambda c: store.create_dataset(c, org_id, project_id, name, kind, now)
    )
    try:
        batch = [_check_row(first[1], kind, first[0])]
        for where, row in rows:
            batch.append(_check_row(row, kind, where))
            if len(batch) >= BATCH:
                svc.db.transact_sync(lambda c, b=batch: store.append_rows(c, ds.id, b, now))
                batch = []
        if batch:
            svc.db.transact_sync(lambda c, b=batch: store.append_rows(c, ds.id, b, now))
    except BaseException:
        svc.db.transact_sync(lambda c: store.delete_dataset(c, ds.id))
        raise
    result: store.Dataset = svc.db.read_sync(lambda c: store.get_dataset(c, org_id, ds.id))
    return result


def _format(request: Request) -> str:
    fmt = request.query_params.get("format")
    if fmt is None:
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip()
        fmt = _FORMATS.get(ctype.lower())
    if fmt not in ("json", "jsonl", "csv", "parquet"):
        raise InvalidRequest(
            "send a JSON body {name, kind} for an empty dataset, or a JSONL, CSV or Parquet "
            "file (Content-Type application/x-ndjson, text/csv or application/vnd.apache.parquet,"
            " or ?format=jsonl|csv|parquet)",
            param="Content-Type",
            code="unsupported_dataset_format",
        )
    return fmt


@router.post("/v1/projects/{project_id}/datasets")
async def create_dataset(request: Request, project_id: str) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL)
    svc = service_of(request)
    org = principal.org_id
    await svc.db.read(lambda c: store.get_project(c, org, project_id))
    fmt = _format(request)
    if fmt == "json":
        body = await read_json(request)
        name = _name(body.get("name"))
        kind = body.get("kind", "text")
        if kind not in KINDS:
            raise InvalidRequest("kind must be text or chat-sft", param="kind")
        now = svc.clock.now()
        ds = await svc.db.transact(
            lambda c: store.create_dataset(c, org, project_id, name, kind, now)
        )
        return json_response(dataset_json(ds), 201)
    name = _name(request.query_params.get("name"), "name")
    kind_param = request.query_params.get("kind")
    if kind_param is not None and kind_param not in KINDS:
        raise InvalidRequest("kind must be text or chat-sft", param="kind")
    cap = int(svc.settings.raw.get("max_upload_bytes", 2 * 1024**3))
    with tempfile.TemporaryFile(prefix="batchyard-upload-") as f:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise PayloadTooLarge(f"the upload is over {cap} bytes")
            f.write(chunk)
        f.seek(0)
        loop = asyncio.get_running_loop()
        ds = await loop.run_in_executor(
            None, _import, svc, f, fmt, org, project_id, name, kind_param
        )
    return json_response(dataset_json(ds), 201)


@router.get("/v1/projects/{project_id}/datasets/{dataset_id}")
async def get_dataset(request: Request, project_id: str, dataset_id: str) -> JSONResponse:
    principal = await authenticate(request, *READ)
    svc = service_of(request)
    ds = await svc.db.read(lambda c: store.get_dataset(c, principal.org_id, dataset_id, project_id))
    return json_response(dataset_json(ds))


@router.get("/v1/projects/{project_id}/datasets/{dataset_id}/rows")
async def list_rows(request: Request, project_id: str, dataset_id: str) -> JSONResponse:
    principal = await authenticate(request, *READ)
    svc = service_of(request)
    limit = _limit(request)
    cursor = request.query_params.get("cursor") or None
    if cursor is not None and not cursor.isdigit():
        raise InvalidRequest("cursor is not one this API gave out", param="cursor")
    after = int(cursor) if cursor else None

    def tx(c: Connection) -> list[store.Row]:
        store.get_dataset(c, principal.org_id, dataset_id, project_id)
        return store.list_rows(c, dataset_id, after=after, limit=limit + 1)

    rows = await svc.db.read(tx)
    more = len(rows) > limit
    rows = rows[:limit]
    return json_response(
        {
            "data": [row_json(r) for r in rows],
            "hasMore": more,
            "nextCursor": str(rows[-1].id) if more else None,
        }
    )


@router.patch("/v1/projects/{project_id}/datasets/{dataset_id}/rows/{row_id}")
async def patch_row(
    request: Request, project_id: str, dataset_id: str, row_id: str
) -> JSONResponse:
    """Merge ``{"data": {...}}`` into a row as a new version; ``null`` removes a field."""
    principal = await authenticate(request, Scope.FULL)
    svc = service_of(request)
    body = await read_json(request)
    changes = body.get("data")
    if not isinstance(changes, dict) or not changes:
        raise InvalidRequest("data must be an object of the fields to change", param="data")
    if not row_id.isdigit():
        raise NotFound(f"row {row_id} not found", param="rowId")
    now = svc.clock.now()

    def tx(c: Connection) -> store.Row:
        ds = store.get_dataset(c, principal.org_id, dataset_id, project_id)
        if ds.kind == "chat-sft":
            merged = {**store.get_row(c, dataset_id, int(row_id)).data, **changes}
            _check_row(merged, ds.kind, "data")
        return row_versions.patch_row(c, dataset_id, int(row_id), changes, now)

    return json_response(row_json(await svc.db.transact(tx)))
