"""Batch inference runs: ``/v1/projects/{projectId}/batch-inference-runs`` (``service.runs``).

A run's body is checked against its dataset before its Idempotency-Key is
claimed, so a refused request leaves nothing and the key stays free.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from batchyard.api.context import (
    Caller,
    Empty,
    ServiceDep,
    camel_page,
    finished_query,
    once,
    path_id,
    query_cursor,
    query_id_cursor,
    query_limit,
    read_json,
)
from batchyard.api.openapi import Finished, ListOf, declare
from batchyard.api.projects import ProjectId
from batchyard.core.accounts import Principal
from batchyard.core.inputs import strict
from batchyard.core.runs import RunStatus
from batchyard.errors import InvalidRequest
from batchyard.service import runs
from batchyard.service.runs import RunBody

__all__ = ["router"]

router = APIRouter()
BASE = "/v1/projects/{project_id}/batch-inference-runs"
RunId = Annotated[str, path_id("run_id", "bir", "batch inference run", param="runId")]


class RunPath(NamedTuple):
    principal: Principal
    project_id: str
    run_id: str


async def _run(principal: Caller, project_id: ProjectId, run_id: RunId) -> RunPath:
    return RunPath(principal, project_id, run_id)


#: The caller and the run its path names: ``runs.get(svc, *run)``.
Run = Annotated[RunPath, Depends(_run)]


@router.post(BASE, status_code=201)
@declare(body=RunBody, errors=(402, 429))
async def create_run(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> Response:
    raw = await read_json(request)
    checked = await runs.check(svc, principal, project_id, strict(RunBody, raw))
    return await once(
        request,
        principal,
        raw,
        lambda: runs.create(svc, principal, checked),
        status=201,
        required=True,
    )


@router.get(BASE)
@declare(ListOf)
async def list_runs(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> JSONResponse:
    status = request.query_params.get("status") or None
    if status is not None and status not in set(RunStatus):
        raise InvalidRequest(f"status {status[:40]!r} is not a run status", param="status")
    limit = query_limit(request, default=20, most=100)
    before = query_id_cursor(request, "bir")
    found = await runs.list_views(
        svc, principal, project_id, status=status, before=before, limit=limit + 1
    )
    return JSONResponse(camel_page(found, limit, lambda r: str(r["id"])))


@router.get(BASE + "/{run_id}")
async def get_run(run: Run, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await runs.get(svc, *run))


@router.post(BASE + "/{run_id}/confirm")
@declare(errors=(402,))
async def confirm_run(request: Request, run: Run, body: Empty, svc: ServiceDep) -> Response:
    """Reserve the quote and queue the run, or block it (funds, billing review)."""
    return await once(request, run.principal, body, lambda: runs.confirm(svc, *run))


@router.post(BASE + "/{run_id}/cancel")
async def cancel_run(request: Request, run: Run, body: Empty, svc: ServiceDep) -> Response:
    """Stop a run: answered rows are kept and charged, the rest is released."""
    return await once(request, run.principal, body, lambda: runs.cancel(svc, *run))


@router.get(BASE + "/{run_id}/failures")
@declare(ListOf)
async def list_failures(request: Request, run: Run, svc: ServiceDep) -> JSONResponse:
    """Rows that failed, and rows left ``uncertain`` by a worker that died mid-call."""
    after = query_cursor(request)
    limit = query_limit(request, default=100, most=1000)
    rows = await runs.failures(svc, *run, after=after, limit=limit + 1)
    return JSONResponse(camel_page(rows, limit, lambda r: str(r["rowId"])))


@router.get(
    BASE + "/{run_id}/finished",
    summary="A batchyard extension: the rows that ended so far, from a cursor, while it runs",
)
@declare(Finished)
async def run_finished(request: Request, run: Run, svc: ServiceDep) -> JSONResponse:
    after, limit = finished_query(request)
    return JSONResponse(await runs.finished(svc, *run, after=after, limit=limit))


@router.post(
    BASE + "/{run_id}/retry",
    status_code=201,
    summary="A new run of the failed and canceled rows, quoted and awaiting confirmation",
)
async def retry(request: Request, run: Run, body: Empty, svc: ServiceDep) -> Response:
    """A new run of an ended run's failed and canceled rows, quoted and awaiting confirmation."""
    return await once(request, run.principal, body, lambda: runs.retry(svc, *run), status=201)
