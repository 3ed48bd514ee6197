"""Projects and their datasets: made empty or from an uploaded file, read, a row patched.

An upload has been spooled to a temporary file by its door; it is parsed and
inserted in batches on a thread, so a large file never sits in memory whole, and
one that fails part-way leaves no dataset behind. Its rows obey the same strict
JSON as request bodies (a ``NaN`` is refused with the line it is on).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import csv
import json
from collections.abc import Iterator
from typing import IO, Any

from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.inputs import check_document, parse_json
from batchyard.core.runs import prompt_messages
from batchyard.errors import BatchyardError, InvalidRequest
from batchyard.service.deployment import Service
from batchyard.store import projects as store
from batchyard.store import row_versions

__all__ = [
    "FORMATS",
    "check_kind",
    "check_name",
    "create_dataset",
    "create_project",
    "dataset_view",
    "get_dataset",
    "get_project",
    "import_dataset",
    "list_rows",
    "patch_row",
]

KINDS = ("text", "chat-sft")
#: The file formats a dataset is made from (``json`` is an empty dataset's body).
FORMATS = ("json", "jsonl", "csv", "parquet")
BATCH = 1000


def project_view(p: store.Project) -> dict[str, Any]:
    return {
        "id": p.id,
        "name": p.name,
        "createdAt": isoformat(p.created_at),
        "updatedAt": isoformat(p.updated_at),
    }


def dataset_view(d: store.Dataset) -> dict[str, Any]:
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


def row_view(r: store.Row) -> dict[str, Any]:
    return {"id": r.id, "version": r.version, "data": r.data, "updatedAt": isoformat(r.updated_at)}


def check_name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 200:
        raise InvalidRequest("name must be a string of 1 to 200 characters", param="name")
    return value.strip()


def check_kind(value: str | None) -> str | None:
    if value is not None and value not in KINDS:
        raise InvalidRequest("kind must be text or chat-sft", param="kind")
    return value


async def create_project(svc: Service, principal: Principal, name: str) -> dict[str, Any]:
    now = svc.clock.now()
    project = await svc.db.transact(lambda c: store.create_project(c, principal.org_id, name, now))
    return project_view(project)


async def get_project(svc: Service, principal: Principal, project_id: str) -> dict[str, Any]:
    project = await svc.db.read(lambda c: store.get_project(c, principal.org_id, project_id))
    return project_view(project)


async def get_dataset(
    svc: Service, principal: Principal, project_id: str, dataset_id: str
) -> dict[str, Any]:
    ds = await svc.db.read(lambda c: store.get_dataset(c, principal.org_id, dataset_id, project_id))
    return dataset_view(ds)


async def create_dataset(
    svc: Service, principal: Principal, project_id: str, name: str, kind: str
) -> dict[str, Any]:
    """An empty dataset."""
    now = svc.clock.now()
    ds = await svc.db.transact(
        lambda c: store.create_dataset(c, principal.org_id, project_id, name, kind, now)
    )
    return dataset_view(ds)


async def list_rows(
    svc: Service,
    principal: Principal,
    project_id: str,
    dataset_id: str,
    *,
    after: int | None,
    limit: int,
) -> list[dict[str, Any]]:
    def tx(c: Connection) -> list[store.Row]:
        store.get_dataset(c, principal.org_id, dataset_id, project_id)
        return store.list_rows(c, dataset_id, after=after, limit=limit)

    return [row_view(r) for r in await svc.db.read(tx)]


async def patch_row(
    svc: Service,
    principal: Principal,
    project_id: str,
    dataset_id: str,
    row_id: int,
    changes: dict[str, Any],
) -> dict[str, Any]:
    """Merge ``changes`` into a row as a new version; ``null`` removes a field."""
    now = svc.clock.now()

    def tx(c: Connection) -> store.Row:
        ds = store.get_dataset(c, principal.org_id, dataset_id, project_id)
        if ds.kind == "chat-sft":
            merged = {**store.get_row(c, dataset_id, row_id).data, **changes}
            _check_row(merged, ds.kind, "data")
        return row_versions.patch_row(c, dataset_id, row_id, changes, now)

    return row_view(await svc.db.transact(tx))


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


async def import_dataset(
    svc: Service,
    principal: Principal,
    project_id: str,
    f: IO[bytes],
    *,
    fmt: str,
    name: str,
    kind: str | None,
) -> dict[str, Any]:
    """A dataset made from a spooled upload of ``fmt``; ``kind`` None reads it from the rows."""
    loop = asyncio.get_running_loop()
    ds = await loop.run_in_executor(
        None, _import, svc, f, fmt, principal.org_id, project_id, name, kind
    )
    return dataset_view(ds)
