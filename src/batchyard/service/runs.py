"""Batch inference runs as their owner drives them: create, read, confirm, cancel, retry.

A run's body is checked against its dataset before a run exists (``check``), so
the worker can trust a run's ``spec`` as written; it is created in ``preparing``
and the worker prices it (``awaiting_confirmation``). Nothing is reserved before
``confirm``, nor charged beyond the rows answered. Field names are the wire's
(docs/reference/runs.md): camelCase, so some break Python's conventions on purpose.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field
from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.filters import RowFilter, compile_filter
from batchyard.core.ids import is_id, new_id
from batchyard.core.inputs import SOME_TEXT, Coded, Shape
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
from batchyard.service import following, model_versions
from batchyard.service.deployment import Service
from batchyard.store import projects as pstore
from batchyard.store import runs as rstore
from batchyard.store import work_items
from batchyard.work.runs.canceling import canceled_by_owner, stop_run
from batchyard.work.runs.funding import fund
from batchyard.work.runs.quoting import retry_run

__all__ = [
    "RunBody",
    "cancel",
    "check",
    "confirm",
    "create",
    "failures",
    "finished",
    "get",
    "list_views",
    "retry",
    "run_view",
]

S = RunStatus
_SAMPLING = Coded("sampling_out_of_range")


class RunModelRef(Shape):
    type: str
    id: str


class RunMode(Shape):
    type: Annotated[Literal["single_turn"], Coded("unsupported_mode")]


class RunInput(Shape):
    type: Annotated[Literal["messages", "field"], Coded("unsupported_input")]
    field: str | None = None


class RunOutput(Shape):
    type: Annotated[Literal["field", "dataset"], Coded("unsupported_output_type")]
    field: str | None = Field(default=None, min_length=1, max_length=200)
    name: str | None = Field(default=None, max_length=200, pattern=SOME_TEXT)


class RunSampling(Shape):
    maxOutputTokens: int | None = None
    samplesPerRow: Annotated[
        int | None,
        Field(ge=1, le=MAX_SAMPLES_PER_ROW),
        Coded("samples_per_row_out_of_range", f"from 1 to {MAX_SAMPLES_PER_ROW}"),
    ] = None
    temperature: Annotated[float | None, Field(ge=0, le=2), _SAMPLING] = None
    topP: Annotated[float | None, Field(gt=0, le=1), _SAMPLING] = None


class RunBody(Shape):
    """``POST /v1/projects/{id}/batch-inference-runs``."""

    datasetId: str
    model: RunModelRef
    output: RunOutput
    mode: RunMode | None = None
    input: RunInput | None = None
    sampling: RunSampling | None = None
    filter: dict[str, Any] | None = None


@dataclass(frozen=True)
class Checked:
    """A run's body checked against its dataset: what ``create`` writes."""

    dataset: pstore.Dataset
    spec: dict[str, Any]


def run_view(run: rstore.Run) -> dict[str, Any]:
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


def _read(body: RunBody, ds: pstore.Dataset) -> dict[str, Any]:
    """Where each row's prompt is read from: its ``messages``, or one text field."""
    source = body.input or RunInput(type="messages" if ds.kind == "chat-sft" else "field")
    if source.type == "messages":
        if "messages" not in ds.fields and ds.row_count:
            raise InvalidRequest(
                "the dataset's rows have no `messages` field",
                param="input",
                code="input_field_not_found",
            )
        return {"type": "messages"}
    field = "text" if body.input is None else source.field
    if not field:
        raise InvalidRequest("input.field must name a field", param="input.field")
    if field not in ds.fields:
        raise InvalidRequest(
            f"the dataset has no field {field!r}",
            param="input.field",
            code="input_field_not_found",
        )
    return {"type": "field", "field": field}


def _output(out: RunOutput, read: dict[str, Any]) -> dict[str, Any]:
    """Where the answers go: a field of the same rows, or a new dataset."""
    if out.type == "dataset":
        if not out.name or not out.name.strip() or len(out.name) > 200:
            raise InvalidRequest("output.name must be 1 to 200 characters", param="output.name")
        return {"type": "dataset", "name": out.name.strip()}
    if not out.field or len(out.field) > 200:
        raise InvalidRequest("output.field must name a field", param="output.field")
    if out.field == read.get("field", "messages"):
        raise InvalidRequest(
            f"output.field {out.field!r} would overwrite the prompt the rows are read from",
            param="output.field",
            code="output_overwrites_input",
        )
    return {"type": "field", "field": out.field}


def _spec(svc: Service, body: RunBody, ds: pstore.Dataset) -> dict[str, Any]:
    """The run's spec, normalised, or the 400 that names what is wrong."""
    model, _, _ = resolve_model(svc.catalog, body.model.model_dump(), ds.org_id)
    if model.project_id is not None and model.project_id != ds.project_id:
        # docs/reference/runs.md: "a model version in this project".
        raise UnknownModel(
            f"model version {model.id} is not in project {ds.project_id}", param="model.id"
        )
    read = _read(body, ds)
    sampling = body.sampling or RunSampling()
    most = model.max_output_tokens
    max_out = sampling.maxOutputTokens
    max_out = min(svc.settings.default_max_tokens, most) if max_out is None else max_out
    if not 1 <= max_out <= most:
        raise InvalidRequest(
            f"sampling.maxOutputTokens must be from 1 to {most} for {model.id}",
            param="sampling.maxOutputTokens",
            code="max_output_tokens_out_of_range",
        )
    t, p = sampling.temperature, sampling.topP
    return {
        "model": {"type": model.type, "id": model.id},
        "mode": {"type": "single_turn"},
        "input": read,
        "output": _output(body.output, read),
        "sampling": {
            "maxOutputTokens": max_out,
            "samplesPerRow": sampling.samplesPerRow or 1,
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


async def check(svc: Service, principal: Principal, project_id: str, body: RunBody) -> Checked:
    """The run ``body`` asks for, checked against its dataset: a 400 or 404 leaves nothing."""
    dataset_id = body.datasetId
    if not is_id(dataset_id, "ds"):
        raise InvalidRequest("datasetId must be a dataset ID (ds.<uuid>)", param="datasetId")

    def lookup(c: Connection) -> pstore.Dataset:
        pstore.get_project(c, principal.org_id, project_id)
        return pstore.get_dataset(c, principal.org_id, dataset_id, project_id)

    ds = await svc.db.read(lookup)
    # A project version is read from the store off the event loop.
    await model_versions.resolve(svc, body.model.id)
    spec = _spec(svc, body, ds)
    keep = compile_filter(spec["filter"])
    loop = asyncio.get_running_loop()
    found = await loop.run_in_executor(None, _any_row_matches, svc, ds.id, keep, spec["input"])
    if not found:
        raise EmptyFilterResult(
            "no row of the dataset matches the filter with a prompt to send", param="filter"
        )
    return Checked(ds, spec)


async def create(svc: Service, principal: Principal, checked: Checked) -> dict[str, Any]:
    """A new run in ``preparing``; the worker is woken to price it."""
    now = svc.clock.now()
    run_id = new_id("bir", now)
    ds = checked.dataset

    def tx(c: Connection) -> rstore.Run:
        rstore.create_run(
            c,
            run_id=run_id,
            org_id=principal.org_id,
            project_id=ds.project_id,
            dataset_id=ds.id,
            spec=checked.spec,
            now=now,
            key_id=principal.key_id,
        )
        return rstore.load_run(c, run_id)

    run = await svc.db.transact(tx)
    svc.runs.notify()
    return run_view(run)


async def list_views(
    svc: Service,
    principal: Principal,
    project_id: str,
    *,
    status: str | None,
    before: str | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Up to ``limit`` runs of the project, newest first, from before the cursor."""

    def tx(c: Connection) -> list[rstore.Run]:
        pstore.get_project(c, principal.org_id, project_id)
        return rstore.list_runs(
            c, principal.org_id, project_id, status=status, before=before, limit=limit
        )

    return [run_view(r) for r in await svc.db.read(tx)]


async def get(svc: Service, principal: Principal, project_id: str, run_id: str) -> dict[str, Any]:
    run = await svc.db.read(lambda c: rstore.get_run(c, principal.org_id, run_id, project_id))
    return run_view(run)


async def _changed(
    svc: Service,
    principal: Principal,
    project_id: str,
    run_id: str,
    change: Callable[[Connection, rstore.Run, datetime], rstore.Run],
) -> dict[str, Any]:
    """Confirm or cancel: the run, locked, changed; the worker is woken."""
    now = svc.clock.now()

    def tx(c: Connection) -> rstore.Run:
        run = rstore.get_run(c, principal.org_id, run_id, project_id, lock=True)
        return change(c, run, now)

    run = await svc.db.transact(tx)
    svc.runs.notify()
    return run_view(run)


async def confirm(
    svc: Service, principal: Principal, project_id: str, run_id: str
) -> dict[str, Any]:
    """Reserve the quote and queue the run, or block it (funds, billing review)."""

    def confirmed(c: Connection, run: rstore.Run, now: datetime) -> rstore.Run:
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

    return await _changed(svc, principal, project_id, run_id, confirmed)


async def cancel(
    svc: Service, principal: Principal, project_id: str, run_id: str
) -> dict[str, Any]:
    """Stop a run: answered rows are kept and charged, the rest is released."""

    def canceled(c: Connection, run: rstore.Run, now: datetime) -> rstore.Run:
        return stop_run(c, run, now, error=canceled_by_owner(principal.key_id, now))

    return await _changed(svc, principal, project_id, run_id, canceled)


async def failures(
    svc: Service,
    principal: Principal,
    project_id: str,
    run_id: str,
    *,
    after: int | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Rows that failed, and rows left ``uncertain`` by a worker that died mid-call."""

    def tx(c: Connection) -> list[dict[str, Any]]:
        rstore.get_run(c, principal.org_id, run_id, project_id)
        return work_items.list_failures(c, run_id, after=after, limit=limit)

    rows = await svc.db.read(tx)
    for r in rows:
        r["updatedAt"] = isoformat(r["updatedAt"]) if r["updatedAt"] else None
    return rows


async def finished(
    svc: Service, principal: Principal, project_id: str, run_id: str, *, after: int, limit: int
) -> dict[str, Any]:
    """The rows that ended after the cursor (``service.following``)."""

    def read(c: Connection) -> dict[str, Any]:
        # The status first, in the same read: a run seen ended has every row numbered.
        run = rstore.get_run(c, principal.org_id, run_id, project_id)
        items = following.run_items(c, run.id, after=after, limit=limit)
        return following.page(items, after=after, limit=limit, ended=run.status in TERMINAL)

    return await svc.db.read(read)


async def retry(svc: Service, principal: Principal, project_id: str, run_id: str) -> dict[str, Any]:
    """A new run of an ended run's failed and canceled rows, quoted and awaiting confirmation."""
    now = svc.clock.now()
    original = await svc.db.read(lambda c: rstore.get_run(c, principal.org_id, run_id, project_id))
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
    return {**run_view(run), "retry": report}
