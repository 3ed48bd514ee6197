"""Anthropic's Message Batches, as file batches: one machinery, a second dialect.

A Message Batch is taken in as the file of ``/v1/messages`` lines it stands for
(``service.files.ingest``) and created as a file batch; the file-batch worker answers
it. What this module adds is only the dialect: the create body, the ``message_batch``
object, its paging, and each result line as ``{custom_id, result}``.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import AsyncIterator, Sequence
from decimal import Decimal
from functools import partial
from typing import Annotated, Any

from pydantic import Field
from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.anthropic_bodies import MessagesRequest, batch_counts, error_type
from batchyard.core.clock import isoformat
from batchyard.core.inputs import Coded, Shape, field, strict
from batchyard.errors import BatchyardError, InsufficientCredit, InvalidState, NotFound
from batchyard.service import file_batches, files
from batchyard.service.batch_requests import CUSTOM_ID
from batchyard.service.deployment import Service
from batchyard.service.file_batches import PERCENT
from batchyard.service.openai_requests import MESSAGES
from batchyard.store import file_batches as store

__all__ = [
    "MessageBatchBody",
    "cancel",
    "create",
    "finished",
    "get",
    "list_page",
    "results",
    "retry",
]

_ENDED = file_batches.ENDED


class MessageBatchRequest(Shape):
    custom_id: str = Field(pattern=CUSTOM_ID.pattern)
    params: MessagesRequest


_Percent = Annotated[
    Annotated[float, Field(ge=0, le=100)] | Annotated[str, Field(pattern=PERCENT)],
    Coded("min_discount_out_of_range", "a percentage from 0 to 100"),
]


class MessageBatchBody(Shape):
    """``POST /v1/messages/batches``: Anthropic's requests, and batchyard's ``min_discount``."""

    requests: list[MessageBatchRequest] = Field(min_length=1, max_length=100_000)
    min_discount: _Percent | None = None


def _jsonl(raw: dict[str, Any]) -> tuple[bytes, Decimal | None]:
    """The create body as the batch file it stands for, and the discount it waits for."""
    body = strict(MessageBatchBody, raw)
    out = io.BytesIO()
    for item in raw["requests"]:
        line = {"custom_id": item["custom_id"], "method": "POST", "url": MESSAGES}
        line["body"] = item["params"]
        out.write(_jsonl_line(line))
    given = body.min_discount
    return out.getvalue(), None if given is None else Decimal(str(given))


def _jsonl_line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _as_request_error(exc: BatchyardError) -> BatchyardError:
    """A line's error (``line N: ...``) named as the request it came from."""
    line = exc.details.get("line") if isinstance(exc.details, dict) else None
    if not isinstance(line, int):
        return exc
    where = f"requests.{line - 1}"
    message = re.sub(r"^line \d+: ", f"{where}: ", exc.message)
    param = exc.param
    if isinstance(param, str):
        rest = param.removeprefix(f"line {line}: ").removeprefix("body.")
        param = f"{where}.{rest}" if rest == "custom_id" else f"{where}.params.{rest}"
    details = {k: v for k, v in exc.details.items() if k != "line"}
    return type(exc)(message, param=param, code=exc.code, details=details, status=exc.status)


async def create(svc: Service, principal: Principal, raw: dict[str, Any]) -> dict[str, Any]:
    """Take the requests in, hold the quote, start the batch; its ``message_batch``."""
    svc.batch_key.require()
    given = raw.get("requests")
    named = enumerate(given if isinstance(given, list) else [])
    names = [(f"requests.{i}.params", field(r, "params", "model")) for i, r in named]
    await asyncio.to_thread(svc.preparer.served, names, principal.org_id)
    text, min_discount = _jsonl(raw)
    try:
        taken = await asyncio.to_thread(
            files.ingest,
            svc,
            principal,
            io.BytesIO(text),
            filename="message_batch.jsonl",
            purpose="batch",
            strict=True,
        )
    except BatchyardError as exc:
        raise _as_request_error(exc) from None
    least = str(min_discount) if min_discount is not None else None
    parsed = file_batches.Creation(taken["id"], MESSAGES, "24h", min_discount=least)
    view = _held(await file_batches.create(svc, principal, parsed))
    return await get(svc, principal, view["id"], base_url="")


def _held(view: dict[str, Any]) -> dict[str, Any]:
    """A file batch written failed at creation lacked the credit: Anthropic's 402."""
    if view["status"] == "failed":
        errors = (view.get("errors") or {}).get("data") or [{}]
        raise InsufficientCredit(str(errors[0].get("message", "not enough credit")))
    return view


def _view(row: store.BatchRow, totals: store.Totals, base_url: str) -> dict[str, Any]:
    per = totals.per_state
    processing = "ended" if row.status in _ENDED else row.status
    if processing not in ("in_progress", "canceling", "ended"):
        processing = "in_progress"
    ended_at = row.completed_at or row.failed_at or row.expired_at or row.cancelled_at
    return {
        "id": row.id,
        "type": "message_batch",
        "processing_status": processing,
        "request_counts": batch_counts(per),
        "created_at": isoformat(row.created_at),
        "expires_at": isoformat(row.expires_at),
        "ended_at": isoformat(ended_at) if ended_at is not None else None,
        "cancel_initiated_at": isoformat(row.cancelling_at) if row.cancelling_at else None,
        "archived_at": None,
        "results_url": (
            f"{base_url}/v1/messages/batches/{row.id}/results" if processing == "ended" else None
        ),
        # batchyard's, only where there is one (Anthropic's object has no such fields): the
        # batch this one retries, and the batch that retried it.
        **({"retry_of": row.retry_of} if row.retry_of else {}),
        **({"retried_by": row.retried_by} if row.retried_by else {}),
    }


def _load(conn: Connection, principal: Principal, batch_id: str) -> store.BatchRow:
    row = store.get_batch(conn, principal.org_id, batch_id, key_id=principal.own_key)
    if row is None or row.endpoint != MESSAGES:
        raise NotFound(f"message batch {batch_id} not found", param="message_batch_id")
    return row


async def get(
    svc: Service, principal: Principal, batch_id: str, *, base_url: str
) -> dict[str, Any]:
    def read(conn: Connection) -> dict[str, Any]:
        row = _load(conn, principal, batch_id)
        return _view(row, store.totals(conn, [row.id])[row.id], base_url)

    return await svc.db.read(read)


async def list_page(
    svc: Service,
    principal: Principal,
    *,
    limit: int,
    after: str | None,
    before: str | None,
    base_url: str,
) -> dict[str, Any]:
    """Anthropic's page: newest first, ``after_id`` older, ``before_id`` newer."""

    def read(conn: Connection) -> dict[str, Any]:
        rows = store.list_batches(
            conn,
            principal.org_id,
            after=after,
            before=before,
            limit=limit + 1,
            key_id=principal.own_key,
            endpoint=MESSAGES,
        )
        more = len(rows) > limit
        rows = rows[1:] if more and before else rows[:limit]
        totals = store.totals(conn, [r.id for r in rows])
        data = [_view(r, totals[r.id], base_url) for r in rows]
        return {
            "data": data,
            "has_more": more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }

    return await svc.db.read(read)


async def cancel(
    svc: Service, principal: Principal, batch_id: str, *, base_url: str
) -> dict[str, Any]:
    """Stop sending: requests not yet sent end ``canceled``; an ended batch is a 409."""
    await svc.db.read(lambda c: _load(c, principal, batch_id))
    try:
        await file_batches.cancel(svc, principal, batch_id)
    except InvalidState as exc:
        if exc.code != "batch_not_cancellable":
            raise
    return await get(svc, principal, batch_id, base_url=base_url)


async def retry(
    svc: Service, principal: Principal, batch_id: str, *, base_url: str
) -> dict[str, Any]:
    """A new Message Batch of an ended one's errored, canceled and expired requests
    (``service.file_batches.retry``); without the credit, 402 as at create."""
    await svc.db.read(lambda c: _load(c, principal, batch_id))
    view = _held(await file_batches.retry(svc, principal, batch_id))
    answer = await get(svc, principal, view["id"], base_url=base_url)
    answer["retry"] = view["retry"]
    return answer


async def finished(
    svc: Service, principal: Principal, batch_id: str, *, after: int, limit: int
) -> dict[str, Any]:
    """The requests that ended after ``after``, as the results file shows them."""
    await svc.db.read(lambda c: _load(c, principal, batch_id))
    return await file_batches.finished(
        svc, principal, batch_id, after=after, limit=limit, render=_result
    )


def _result(line: dict[str, Any]) -> dict[str, Any]:
    """One stored result line (OpenAI's shape) as Anthropic's individual response."""
    cid = line.get("custom_id")
    response = line.get("response")
    if isinstance(response, dict) and response.get("status_code") == 200:
        message = {k: v for k, v in response["body"].items() if k not in ("charge", "route")}
        return {"custom_id": cid, "result": {"type": "succeeded", "message": message}}
    if isinstance(response, dict):
        status = int(response.get("status_code") or 500)
        err = (response.get("body") or {}).get("error") or {}
        return {"custom_id": cid, "result": _errored(status, err)}
    code = (line.get("error") or {}).get("code")
    if code == "batch_expired":
        return {"custom_id": cid, "result": {"type": "expired"}}
    if code == "batch_cancelled":
        return {"custom_id": cid, "result": {"type": "canceled"}}
    return {"custom_id": cid, "result": _errored(500, line.get("error") or {})}


def _errored(status: int, err: dict[str, Any]) -> dict[str, Any]:
    error = {
        "type": error_type(status),
        "message": str(err.get("message", "")),
        "code": str(err.get("code", "error")),
    }
    return {"type": "errored", "error": {"type": "error", "error": error}}


async def results(svc: Service, principal: Principal, batch_id: str) -> AsyncIterator[bytes]:
    """The results as JSON Lines in input order; only once the batch has ended (else 409).

    Checked before the first byte, so a batch still running is an ordinary 409.
    """
    sealer = svc.batch_key.require()
    row = await svc.db.read(lambda c: _load(c, principal, batch_id))
    if row.status not in _ENDED:
        raise InvalidState(
            f"message batch {batch_id} is still {row.status}; its results are ready once "
            "processing_status is ended",
            code="results_not_ready",
        )

    def text(page: Sequence[tuple[int, bytes]]) -> bytes:
        stored = (json.loads(sealer.open(s, store.out_aad(batch_id, n))) for n, s in page)
        return b"".join(_jsonl_line(_result(line)) for line in stored)

    read = partial(store.output_lines, batch_id=batch_id, errors=None, limit=500)
    return files.pages(svc, read, files.first, text)
