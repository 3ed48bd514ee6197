"""Batch inference runs: ``/v1/projects/{projectId}/batch-inference-runs``.

Wire format as docs/reference/runs.md writes it (camelCase). Creating a run validates the
request against the dataset and answers the run in ``preparing`` at once; the
worker freezes the rows and prices them (``awaiting_confirmation`` with a
``quote``). Nothing is reserved before ``confirm``, and nothing is charged
beyond the rows actually answered.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Connection

from batchyard.api.bodies import RunBody
from batchyard.api.context import ServiceDep, authenticate, idempotent, json_response, read_json
from batchyard.api.inputs import (
    finished_query,
    object_id,
    query_cursor,
    query_id_cursor,
    query_limit,
    read_empty,
    strict,
)
from batchyard.api.run_requests import any_row_matches, validate_run_request
from batchyard.core.clock import isoformat
from batchyard.core.filters import compile_filter
from batchyard.core.ids import is_id, new_id
from batchyard.core.money import format_money
from batchyard.core.runs import TERMINAL, RunStatus, message_for
from batchyard.errors import EmptyFilterResult, InvalidRequest, InvalidState, QuoteExpired
from batchyard.service import following, model_versions
from batchyard.store import projects as pstore
from batchyard.store import runs as rstore
from batchyard.store import work_items
from batchyard.work.runs.canceling import canceled_by_owner, stop_run
from batchyard.work.runs.funding import fund
from batchyard.work.runs.quoting import retry_run

__all__ = ["router", "run_json"]

router = APIRouter()
BASE = "/v1/projects/{project_id}/batch-inference-runs"
S = RunStatus


def _ids(project_id: str, run_id: str | None = None) -> None:
    """Path IDs that cannot name anything are 404 before the store is asked."""
    object_id(project_id, "pp", param="projectId", what="project")
    if run_id is not None:
        object_id(run_id, "bir", param="runId", what="batch inference run")


def _output(run: rstore.Run) -> dict[str, Any]:
    out = dict(run.spec["output"])
    out["datasetId"] = run.dataset_id if out["type"] == "field" else run.output_dataset_id
    return out


def run_json(run: rstore.Run) -> dict[str, Any]:
    """A run as docs/reference/runs.md writes it."""
    quote: dict[str, Any] | None = None
    max_cost = expires = None
    if run.quote_max_cost is not None and run.quote_expires_at is not None:
        max_cost = format_money(run.quote_max_cost)
        expires = isoformat(run.quote_expires_at)
        quote = {
            "rows": run.quote_rows,
            "inputTokens": run.quote_input_tokens,
            "maxOutputTokens": run.quote_max_output_tokens,
            "maxCost": max_cost,
            "expiresAt": expires,
        }
    progress = None
    if run.status in (S.RUNNING, S.STOPPING):
        progress = {
            "rowsDone": run.rows_done,
            "rowsFailed": run.rows_failed,
            "rowsUncertain": run.rows_uncertain,
            "rowsTotal": run.rows_total,
            "inputTokens": run.input_tokens,
            "cachedInputTokens": run.cached_input_tokens,
            "outputTokens": run.output_tokens,
        }
    results = None
    if run.status in TERMINAL and run.reservation_id is not None:
        results = {
            "rowsSucceeded": run.rows_done,
            "rowsFailed": run.rows_failed - run.rows_uncertain,
            "rowsUncertain": run.rows_uncertain,
            "rowsCanceled": run.rows_canceled,
            "outputsWritten": run.outputs_written,
            "inputTokens": run.input_tokens,
            "cachedInputTokens": run.cached_input_tokens,
            "outputTokens": run.output_tokens,
        }
    charge = format_money(run.charge) if run.charge is not None else None
    message = message_for(
        run.status,
        blocked_reason=run.blocked_reason,
        run_id=run.id,
        max_cost=max_cost,
        expires=expires,
        done=run.rows_done,
        failed=run.rows_failed,
        total=run.rows_total,
        charge=charge,
        error=(run.error or {}).get("message"),
    )
    return {
        "id": run.id,
        "projectId": run.project_id,
        "datasetId": run.dataset_id,
        "status": run.status,
        "blockedReason": run.blocked_reason,
        "message": message,
        "model": run.spec["model"],
        "mode": run.spec["mode"],
        "input": run.spec["input"],
        "filter": run.spec.get("filter"),
        "output": _output(run),
        "sampling": run.spec["sampling"],
        "quote": quote,
        "progress": progress,
        "results": results,
        "charge": charge,
        "error": run.error,
        "retryOf": run.retry_of,
        "retriedBy": run.retried_by,
        "createdAt": isoformat(run.created_at),
        "updatedAt": isoformat(run.updated_at),
    }


@router.post(BASE)
async def create_run(request: Request, project_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    _ids(project_id)
    raw = await read_json(request)
    dataset_id = strict(RunBody, raw).datasetId
    if not is_id(dataset_id, "ds"):
        raise InvalidRequest("datasetId must be a dataset ID (ds.<uuid>)", param="datasetId")
    org = principal.org_id

    def lookup(c: Connection) -> pstore.Dataset:
        pstore.get_project(c, org, project_id)
        return pstore.get_dataset(c, org, dataset_id, project_id)

    ds = await svc.db.read(lookup)
    named = raw.get("model")
    if isinstance(named, dict):
        # A project version is read from the store off the event loop.
        await model_versions.resolve(svc, named.get("id"))
    spec = validate_run_request(svc, raw, ds)
    keep = compile_filter(spec["filter"])

    # Checked before the key is claimed: a request refused for its content leaves nothing.
    loop = asyncio.get_running_loop()
    found = await loop.run_in_executor(None, any_row_matches, svc, ds.id, keep, spec["input"])
    if not found:
        raise EmptyFilterResult(
            "no row of the dataset matches the filter with a prompt to send", param="filter"
        )

    async def handler() -> tuple[int, Any]:
        now = svc.clock.now()
        run_id = new_id("bir", now)

        def tx(c: Connection) -> rstore.Run:
            rstore.create_run(
                c,
                run_id=run_id,
                org_id=org,
                project_id=project_id,
                dataset_id=ds.id,
                spec=spec,
                now=now,
                key_id=principal.key_id,
            )
            return rstore.load_run(c, run_id)

        run = await svc.db.transact(tx)
        svc.runs.notify()
        return 201, run_json(run)

    return await idempotent(request, principal, raw, handler, required=True)


@router.get(BASE)
async def list_runs(request: Request, project_id: str, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    _ids(project_id)
    status = request.query_params.get("status") or None
    if status is not None and status not in set(S):
        raise InvalidRequest(f"status {status[:40]!r} is not a run status", param="status")
    limit = query_limit(request, default=20, most=100)
    cursor = query_id_cursor(request, "bir")

    def tx(c: Connection) -> list[rstore.Run]:
        pstore.get_project(c, principal.org_id, project_id)
        return rstore.list_runs(
            c, principal.org_id, project_id, status=status, before=cursor, limit=limit + 1
        )

    runs = await svc.db.read(tx)
    more = len(runs) > limit
    runs = runs[:limit]
    return json_response(
        {
            "object": "list",
            "data": [run_json(r) for r in runs],
            "hasMore": more,
            "nextCursor": runs[-1].id if more else None,
        }
    )


@router.get(BASE + "/{run_id}")
async def get_run(request: Request, project_id: str, run_id: str, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    _ids(project_id, run_id)
    run = await svc.db.read(lambda c: rstore.get_run(c, principal.org_id, run_id, project_id))
    return json_response(run_json(run))


@router.post(BASE + "/{run_id}/confirm")
async def confirm_run(request: Request, project_id: str, run_id: str, svc: ServiceDep) -> Response:
    """Reserve the quote and queue the run, or block it (funds, billing review)."""
    principal = await authenticate(request)
    _ids(project_id, run_id)
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        now = svc.clock.now()

        def tx(c: Connection) -> rstore.Run:
            run = rstore.get_run(c, principal.org_id, run_id, project_id, lock=True)
            if run.status != S.AWAITING_CONFIRMATION:
                raise InvalidState(
                    f"run {run_id} is {run.status}; only a run awaiting confirmation can be "
                    "confirmed",
                    details={"status": run.status},
                )
            assert run.quote_expires_at is not None
            if now > run.quote_expires_at:
                raise QuoteExpired(
                    f"the quote expired at {isoformat(run.quote_expires_at)}; create the run "
                    "again for a fresh quote",
                    details={"status": run.status},
                )
            # The key that confirms starts the spending: revoking it stops the run.
            rstore.update_run(c, run_id, now, key_id=principal.key_id)
            fund(
                c,
                rstore.load_run(c, run_id),
                now,
                threshold=svc.settings.billing_review_threshold,
                tiers=svc.settings.tiers,
            )
            return rstore.load_run(c, run_id)

        run = await svc.db.transact(tx)
        svc.runs.notify()
        return 200, run_json(run)

    return await idempotent(request, principal, body, handler)


@router.post(BASE + "/{run_id}/cancel")
async def cancel_run(request: Request, project_id: str, run_id: str, svc: ServiceDep) -> Response:
    """Stop a run: answered rows are kept and charged, the rest is released."""
    principal = await authenticate(request)
    _ids(project_id, run_id)
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        now = svc.clock.now()

        def tx(c: Connection) -> rstore.Run:
            run = rstore.get_run(c, principal.org_id, run_id, project_id, lock=True)
            return stop_run(c, run, now, error=canceled_by_owner(principal.key_id, now))

        run = await svc.db.transact(tx)
        svc.runs.notify()
        return 200, run_json(run)

    return await idempotent(request, principal, body, handler)


@router.get(BASE + "/{run_id}/failures")
async def list_failures(
    request: Request, project_id: str, run_id: str, svc: ServiceDep
) -> JSONResponse:
    """Rows that failed, and rows left ``uncertain`` by a worker that died mid-call."""
    principal = await authenticate(request)
    _ids(project_id, run_id)
    cursor = query_cursor(request)
    limit = query_limit(request, default=100, most=1000)

    def tx(c: Connection) -> list[dict[str, Any]]:
        rstore.get_run(c, principal.org_id, run_id, project_id)
        return work_items.list_failures(c, run_id, after=cursor, limit=limit + 1)

    rows = await svc.db.read(tx)
    more = len(rows) > limit
    rows = rows[:limit]
    for r in rows:
        r["updatedAt"] = isoformat(r["updatedAt"]) if r["updatedAt"] else None
    return json_response(
        {
            "object": "list",
            "data": rows,
            "hasMore": more,
            "nextCursor": str(rows[-1]["rowId"]) if more else None,
        }
    )


@router.get(BASE + "/{run_id}/finished")
async def run_finished(
    request: Request, project_id: str, run_id: str, svc: ServiceDep
) -> JSONResponse:
    """A batchyard extension: the rows that ended so far, from a cursor, while the run runs."""
    principal = await authenticate(request)
    _ids(project_id, run_id)
    after, limit = finished_query(request)

    def read(c: Connection) -> dict[str, Any]:
        # The status first, in the same read: a run seen ended has every row numbered.
        run = rstore.get_run(c, principal.org_id, run_id, project_id)
        items = following.run_items(c, run.id, after=after, limit=limit)
        return following.page(items, after=after, limit=limit, ended=run.status in TERMINAL)

    return json_response(await svc.db.read(read))


@router.post(BASE + "/{run_id}/retry")
async def retry(request: Request, project_id: str, run_id: str, svc: ServiceDep) -> Response:
    """A new run of an ended run's failed and canceled rows, quoted and awaiting confirmation."""
    principal = await authenticate(request)
    _ids(project_id, run_id)
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        now = svc.clock.now()
        original = await svc.db.read(
            lambda c: rstore.get_run(c, principal.org_id, run_id, project_id)
        )
        if original.spec["model"].get("type") == "version":
            # A project version is read from the store off the event loop.
            await model_versions.resolve(svc, original.spec["model"].get("id"))
        new = new_id("bir", now)

        def tx(c: Connection) -> tuple[rstore.Run, dict[str, Any]]:
            run = rstore.get_run(c, principal.org_id, run_id, project_id, lock=True)
            return retry_run(
                c,
                run,
                run_id=new,
                catalog=svc.catalog,
                settings=svc.settings.runs,
                now=now,
                key_id=principal.key_id,
            )

        run, report = await svc.db.transact(tx)
        return 201, {**run_json(run), "retry": report}

    return await idempotent(request, principal, body, handler)
