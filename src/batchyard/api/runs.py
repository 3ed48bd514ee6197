"""Batch inference runs: ``/v1/projects/{projectId}/batch-inference-runs``.

Creating a run checks its body against the dataset before a run exists, so the
worker can trust a run's ``spec`` as written, and answers the run in
``preparing`` at once; the worker prices it (``awaiting_confirmation``).
Nothing is reserved before ``confirm``, nor charged beyond the rows answered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Connection

from batchyard.api.bodies import RunBody, RunInput, RunSampling
from batchyard.api.context import (
    Caller,
    ServiceDep,
    camel_page,
    finished_query,
    idempotent,
    once,
    path_id,
    query_cursor,
    query_id_cursor,
    query_limit,
    read_empty,
    read_json,
)
from batchyard.api.openapi import EmptyBody, Finished, ListOf, declare
from batchyard.api.projects import ProjectId
from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.filters import RowFilter, compile_filter
from batchyard.core.ids import is_id, new_id
from batchyard.core.inputs import strict
from batchyard.core.money import format_money
from batchyard.core.runs import (
    MAX_SAMPLES_PER_ROW,
    TERMINAL,
    RunStatus,
    message_for,
    prompt_messages,
    resolve_model,
)
from batchyard.errors import (
    EmptyFilterResult,
    InvalidRequest,
    InvalidState,
    QuoteExpired,
    UnknownModel,
)
from batchyard.service import Service, following, model_versions
from batchyard.store import projects as pstore
from batchyard.store import runs as rstore
from batchyard.store import work_items
from batchyard.work.runs.canceling import canceled_by_owner, stop_run
from batchyard.work.runs.funding import fund
from batchyard.work.runs.quoting import retry_run

__all__ = ["router"]

router = APIRouter()
BASE = "/v1/projects/{project_id}/batch-inference-runs"
S = RunStatus
RunId = Annotated[str, path_id("run_id", "bir", "batch inference run", param="runId")]


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
    tokens = {
        "inputTokens": run.input_tokens,
        "cachedInputTokens": run.cached_input_tokens,
        "outputTokens": run.output_tokens,
    }
    progress = results = None
    if run.status in (S.RUNNING, S.STOPPING):
        progress = {
            "rowsDone": run.rows_done,
            "rowsFailed": run.rows_failed,
            "rowsUncertain": run.rows_uncertain,
            "rowsTotal": run.rows_total,
            **tokens,
        }
    if run.status in TERMINAL and run.reservation_id is not None:
        results = {
            "rowsSucceeded": run.rows_done,
            "rowsFailed": run.rows_failed - run.rows_uncertain,
            "rowsUncertain": run.rows_uncertain,
            "rowsCanceled": run.rows_canceled,
            "outputsWritten": run.outputs_written,
            **tokens,
        }
    charge = format_money(run.charge) if run.charge is not None else None
    output = run.spec["output"]
    field = output["type"] == "field"
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
        "output": {**output, "datasetId": run.dataset_id if field else run.output_dataset_id},
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


def _spec(svc: Service, body: RunBody, ds: pstore.Dataset) -> dict[str, Any]:
    """The run's spec, normalised, or the 400 that names what is wrong.

    Answered before a run exists, so the worker can trust a run's ``spec`` as written.
    """
    model, _, _ = resolve_model(svc.catalog, body.model.model_dump(), ds.org_id)
    if model.project_id is not None and model.project_id != ds.project_id:
        # docs/reference/runs.md: "a model version in this project".
        raise UnknownModel(
            f"model version {model.id} is not in project {ds.project_id}", param="model.id"
        )
    if body.mode is not None and body.mode.type != "single_turn":
        raise InvalidRequest(
            f"mode.type {body.mode.type!r} is not supported; use single_turn",
            param="mode.type",
            code="unsupported_mode",
        )
    source = body.input or RunInput(type="messages" if ds.kind == "chat-sft" else "field")
    if source.type == "messages":
        if "messages" not in ds.fields and ds.row_count:
            raise InvalidRequest(
                "the dataset's rows have no `messages` field",
                param="input",
                code="input_field_not_found",
            )
        read: dict[str, Any] = {"type": "messages"}
    elif source.type == "field":
        field = "text" if body.input is None else source.field
        if not field:
            raise InvalidRequest("input.field must name a field", param="input.field")
        if field not in ds.fields:
            raise InvalidRequest(
                f"the dataset has no field {field!r}",
                param="input.field",
                code="input_field_not_found",
            )
        read = {"type": "field", "field": field}
    else:
        raise InvalidRequest(
            "input.type must be messages or field", param="input.type", code="unsupported_input"
        )
    out = body.output
    if out.type == "field":
        if not out.field or len(out.field) > 200:
            raise InvalidRequest("output.field must name a field", param="output.field")
        if out.field == read.get("field", "messages"):
            raise InvalidRequest(
                f"output.field {out.field!r} would overwrite the prompt the rows are read from",
                param="output.field",
                code="output_overwrites_input",
            )
        output = {"type": "field", "field": out.field}
    elif out.type == "dataset":
        if not out.name or not out.name.strip() or len(out.name) > 200:
            raise InvalidRequest("output.name must be 1 to 200 characters", param="output.name")
        output = {"type": "dataset", "name": out.name.strip()}
    else:
        raise InvalidRequest(
            "output.type must be field or dataset",
            param="output.type",
            code="unsupported_output_type",
        )
    sampling = body.sampling or RunSampling()
    most = model.max_output_tokens
    max_out = sampling.maxOutputTokens
    max_out = min(svc.settings.default_max_tokens, most) if max_out is None else max_out
    samples = 1 if sampling.samplesPerRow is None else sampling.samplesPerRow
    t, p = sampling.temperature, sampling.topP
    checks = (
        ("maxOutputTokens", 1 <= max_out <= most, f"from 1 to {most} for {model.id}"),
        ("samplesPerRow", 1 <= samples <= MAX_SAMPLES_PER_ROW, f"from 1 to {MAX_SAMPLES_PER_ROW}"),
        ("temperature", t is None or 0 <= t <= 2, "at least 0 and at most 2"),
        ("topP", p is None or 0 < p <= 1, "above 0 and at most 1"),
    )
    codes = {"maxOutputTokens": "max_output_tokens", "samplesPerRow": "samples_per_row"}
    for name, ok, bound in checks:
        if not ok:
            raise InvalidRequest(
                f"sampling.{name} must be {bound}",
                param=f"sampling.{name}",
                code=f"{codes.get(name, 'sampling')}_out_of_range",
            )
    return {
        "model": {"type": model.type, "id": model.id},
        "mode": {"type": "single_turn"},
        "input": read,
        "output": output,
        "sampling": {
            "maxOutputTokens": max_out,
            "samplesPerRow": samples,
            "temperature": None if t is None else float(t),
            "topP": None if p is None else float(p),
        },
        "filter": body.filter,
    }


def _any_row_matches(svc: Any, dataset_id: str, keep: RowFilter, source: dict[str, Any]) -> bool:
    """Whether a current row passes the filter and has a prompt (runs on a thread).

    Checked before a run is created, so a filter that matches nothing is a 400
    at once rather than a run that fails while it is being quoted.
    """
    after = 0
    while True:
        batch = svc.db.read_sync(
            lambda c, a=after: pstore.current_rows(c, dataset_id, after=a, limit=2000)
        )
        if not batch:
            return False
        for _, _, raw in batch:
            data = json.loads(raw)
            if keep(data) and prompt_messages(data, source) is not None:
                return True
        after = batch[-1][0]


@router.post(BASE, status_code=201)
@declare(body=RunBody, errors=(402, 429))
async def create_run(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> Response:
    raw = await read_json(request)
    body = strict(RunBody, raw)
    dataset_id = body.datasetId
    if not is_id(dataset_id, "ds"):
        raise InvalidRequest("datasetId must be a dataset ID (ds.<uuid>)", param="datasetId")
    org = principal.org_id

    def lookup(c: Connection) -> pstore.Dataset:
        pstore.get_project(c, org, project_id)
        return pstore.get_dataset(c, org, dataset_id, project_id)

    ds = await svc.db.read(lookup)
    # A project version is read from the store off the event loop.
    await model_versions.resolve(svc, body.model.id)
    spec = _spec(svc, body, ds)
    keep = compile_filter(spec["filter"])

    # Checked before the key is claimed: a request refused for its content leaves nothing.
    loop = asyncio.get_running_loop()
    found = await loop.run_in_executor(None, _any_row_matches, svc, ds.id, keep, spec["input"])
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
@declare(ListOf)
async def list_runs(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> JSONResponse:
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

    runs = [run_json(r) for r in await svc.db.read(tx)]
    return JSONResponse(camel_page(runs, limit, lambda r: str(r["id"])))


@router.get(BASE + "/{run_id}")
async def get_run(
    principal: Caller, project_id: ProjectId, run_id: RunId, svc: ServiceDep
) -> JSONResponse:
    run = await svc.db.read(lambda c: rstore.get_run(c, principal.org_id, run_id, project_id))
    return JSONResponse(run_json(run))


@router.post(BASE + "/{run_id}/confirm")
@declare(body=EmptyBody, errors=(402,))
async def confirm_run(
    request: Request, principal: Caller, project_id: ProjectId, run_id: RunId, svc: ServiceDep
) -> Response:
    """Reserve the quote and queue the run, or block it (funds, billing review)."""

    def confirm(c: Connection, run: rstore.Run, now: datetime) -> rstore.Run:
        if run.status != S.AWAITING_CONFIRMATION:
            raise InvalidState(
                f"run {run_id} is {run.status}; only a run awaiting confirmation can be confirmed",
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
        settings = svc.settings
        fund(
            c,
            rstore.load_run(c, run_id),
            now,
            threshold=settings.billing_review_threshold,
            tiers=settings.tiers,
        )
        return rstore.load_run(c, run_id)

    return await _changed(request, principal, project_id, run_id, svc, confirm)


@router.post(BASE + "/{run_id}/cancel")
@declare(body=EmptyBody)
async def cancel_run(
    request: Request, principal: Caller, project_id: ProjectId, run_id: RunId, svc: ServiceDep
) -> Response:
    """Stop a run: answered rows are kept and charged, the rest is released."""

    def cancel(c: Connection, run: rstore.Run, now: datetime) -> rstore.Run:
        return stop_run(c, run, now, error=canceled_by_owner(principal.key_id, now))

    return await _changed(request, principal, project_id, run_id, svc, cancel)


async def _changed(
    request: Request,
    principal: Principal,
    project_id: str,
    run_id: str,
    svc: Service,
    change: Callable[[Connection, rstore.Run, datetime], rstore.Run],
) -> Response:
    """Confirm or cancel: the run, locked, changed once per key; the worker is woken."""
    body = await read_empty(request)

    async def answer() -> dict[str, Any]:
        now = svc.clock.now()

        def tx(c: Connection) -> rstore.Run:
            run = rstore.get_run(c, principal.org_id, run_id, project_id, lock=True)
            return change(c, run, now)

        run = await svc.db.transact(tx)
        svc.runs.notify()
        return run_json(run)

    return await once(request, principal, body, answer)


@router.get(BASE + "/{run_id}/failures")
@declare(ListOf)
async def list_failures(
    request: Request, principal: Caller, project_id: ProjectId, run_id: RunId, svc: ServiceDep
) -> JSONResponse:
    """Rows that failed, and rows left ``uncertain`` by a worker that died mid-call."""
    cursor = query_cursor(request)
    limit = query_limit(request, default=100, most=1000)

    def tx(c: Connection) -> list[dict[str, Any]]:
        rstore.get_run(c, principal.org_id, run_id, project_id)
        return work_items.list_failures(c, run_id, after=cursor, limit=limit + 1)

    rows = await svc.db.read(tx)
    for r in rows:
        r["updatedAt"] = isoformat(r["updatedAt"]) if r["updatedAt"] else None
    return JSONResponse(camel_page(rows, limit, lambda r: str(r["rowId"])))


@router.get(
    BASE + "/{run_id}/finished",
    summary="A batchyard extension: the rows that ended so far, from a cursor, while it runs",
)
@declare(Finished)
async def run_finished(
    request: Request, principal: Caller, project_id: ProjectId, run_id: RunId, svc: ServiceDep
) -> JSONResponse:
    after, limit = finished_query(request)

    def read(c: Connection) -> dict[str, Any]:
        # The status first, in the same read: a run seen ended has every row numbered.
        run = rstore.get_run(c, principal.org_id, run_id, project_id)
        items = following.run_items(c, run.id, after=after, limit=limit)
        return following.page(items, after=after, limit=limit, ended=run.status in TERMINAL)

    return JSONResponse(await svc.db.read(read))


@router.post(
    BASE + "/{run_id}/retry",
    status_code=201,
    summary="A new run of the failed and canceled rows, quoted and awaiting confirmation",
)
@declare(body=EmptyBody)
async def retry(
    request: Request, principal: Caller, project_id: ProjectId, run_id: RunId, svc: ServiceDep
) -> Response:
    """A new run of an ended run's failed and canceled rows, quoted and awaiting confirmation."""
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
