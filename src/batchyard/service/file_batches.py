"""File batches (OpenAI's dialect of ``/v1/batches``): create, show, retry, cancel.

A batch from a file with invalid lines is written ``failed`` at once, naming every such
line in ``errors.data`` (OpenAI's order), and nothing is held. Otherwise the whole file is
quoted (each line's tokens, counted at upload, at its model's price) and held in the same
transaction that writes the batch, so nothing is dispatched without its money; without
the credit the batch is written ``failed`` (``insufficient_credit``) in the answer to the
create call. Execution is ``work.file_batches``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator
from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.ids import new_id
from batchyard.core.inputs import Coded, Shape, strict
from batchyard.core.money import format_money, quote_ticks
from batchyard.core.quotes import direct_price
from batchyard.errors import (
    InsufficientCredit,
    InvalidRequest,
    InvalidState,
    NotFound,
    SpendCapExceeded,
)
from batchyard.service import following
from batchyard.service.batch_requests import WINDOWS
from batchyard.service.batch_views import file_batch, load_file_view, openai_status
from batchyard.service.deployment import Service
from batchyard.store import billing, webhook_deliveries
from batchyard.store import file_batches as store
from batchyard.store import files as file_store
from batchyard.store.files import line_aad

__all__ = [
    "ENDED",
    "FILE_WINDOWS",
    "PERCENT",
    "RETRIED",
    "Creation",
    "FileBatchBody",
    "cancel",
    "create",
    "finished",
    "parse_create",
    "retry",
]

log = logging.getLogger("batchyard.file_batches")

#: The statuses of a batch whose every line has ended.
ENDED = ("completed", "failed", "expired", "canceled")
MAX_METADATA = 16
#: The most invalid lines a failed batch lists in ``errors.data``.
MAX_ERRORS = 1000


#: A file batch's windows: OpenAI's 24 h (and deferred batches' shorter ones), and
#: batchyard's longer ones, whose lines wait for a price until 24 h are left
#: (``work.file_batches.lines.waits_until``).
FILE_WINDOWS = {
    **WINDOWS,
    "48h": timedelta(hours=48),
    "72h": timedelta(hours=72),
    "168h": timedelta(hours=168),
}


#: A percentage from 0 to 100 written as a decimal string (metadata values are strings).
PERCENT = r"^(100(\.0+)?|[0-9]{1,2}(\.[0-9]+)?)$"


class BatchMetadata(Shape):
    """OpenAI's metadata (at most 16 pairs of short strings), and batchyard's ``min_discount``."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={"maxProperties": MAX_METADATA, "propertyNames": {"maxLength": 64}},
    )
    __pydantic_extra__: dict[
        Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]
    ]

    #: The least discount to run at, a percentage from 0 to 100.
    min_discount: Annotated[
        Annotated[str, Field(pattern=PERCENT)] | None,
        Coded("min_discount_out_of_range", "a percentage from 0 to 100, as a string"),
    ] = None

    @model_validator(mode="after")
    def _at_most_16(self) -> BatchMetadata:
        if len(self.model_dump(exclude_unset=True)) > MAX_METADATA:
            raise ValueError(f"metadata holds at most {MAX_METADATA} pairs")
        return self


class OutputExpiry(Shape):
    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=2_592_000)


class FileBatchBody(Shape):
    """``POST /v1/batches`` in OpenAI's dialect: the document's schema and the check in one."""

    unknown_code: ClassVar[str] = "unsupported_parameter"

    input_file_id: str = Field(min_length=1)
    endpoint: Annotated[
        Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages"],
        Coded("unsupported_endpoint"),
    ]
    completion_window: Annotated[
        Literal["24h", "6h", "1h", "48h", "72h", "168h"], Coded("invalid_completion_window")
    ]
    metadata: BatchMetadata | None = None
    output_expires_after: OutputExpiry | None = None


@dataclass(frozen=True, slots=True)
class Creation:
    """What ``create`` makes a batch of, as its row keeps it."""

    input_file_id: str
    endpoint: str
    window: str
    #: The metadata as JSON text.
    metadata: str | None = None
    #: The least discount, a percentage.
    min_discount: str | None = None


def parse_create(raw: dict[str, Any]) -> Creation:
    """The file dialect's body checked (no store reads): what ``create`` needs."""
    body = strict(FileBatchBody, raw)
    meta = body.metadata
    text = json.dumps(meta.model_dump(exclude_none=True)) if meta is not None else None
    least = str(Decimal(meta.min_discount)) if meta and meta.min_discount is not None else None
    return Creation(body.input_file_id, body.endpoint, body.completion_window, text, least)


async def create(
    svc: Service, principal: Principal, parsed: Creation, *, retry_of: str | None = None
) -> dict[str, Any]:
    """Write the batch and hold its quote, or write it failed for want of credit.

    ``retry_of``: the batch this one retries, linked both ways in the same
    transaction; a batch that already has a retry refuses a second one.
    """
    sealer = svc.batch_key.require()
    now = svc.clock.now()
    batch_id = new_id("bat", now)
    catalog = svc.catalog
    file_id = parsed.input_file_id

    def tx(conn: Connection) -> dict[str, Any]:
        f = file_store.get_file(conn, principal.org_id, file_id, key_id=principal.own_key)
        if f is None:
            raise NotFound(
                f"file {file_id} not found", param="input_file_id", code="file_not_found"
            )
        if f.deleted_at is not None:
            raise NotFound(
                f"file {file_id} was deleted; upload it again",
                param="input_file_id",
                code="file_deleted",
            )
        if f.purpose != "batch":
            raise InvalidRequest(
                f"file {file_id} has purpose {f.purpose}; a batch reads a file uploaded with "
                "purpose batch",
                param="input_file_id",
                code="invalid_file_purpose",
            )
        totals = list(file_store.line_totals(conn, f.id))
        invalid = [
            json.loads(sealer.open(body, line_aad(f.id, n)))["error"]
            for n, body in file_store.invalid_lines(conn, f.id, limit=MAX_ERRORS)
        ]
        totals = [t for t in totals if t[0] != file_store.INVALID_LINE]
        first = min((t[4] for t in totals), default=1)
        if not invalid and f.endpoint != parsed.endpoint:
            raise InvalidRequest(
                f"line {first}: url {f.endpoint!r} does not match the batch's endpoint "
                f"{parsed.endpoint!r}",
                param=f"line {first}: url",
                code="endpoint_mismatch",
                details={"line": first},
            )
        cost = Decimal(0)
        for model_id, _, tokens_in, tokens_out, line in totals:
            model = catalog.find(model_id)
            if model is None or not catalog.is_available(model_id):
                if invalid:
                    continue  # the batch fails on its invalid lines; this one costs nothing
                raise InvalidRequest(
                    f"line {line}: model {model_id!r} is no longer served here",
                    param=f"line {line}: body.model",
                    code="model_unavailable",
                    details={"line": line},
                )
            cost += direct_price(model).cost(tokens_in, tokens_out)
        max_cost = quote_ticks(cost)
        row = store.BatchRow(
            id=batch_id,
            org_id=principal.org_id,
            key_id=principal.key_id,
            status="in_progress",
            endpoint=parsed.endpoint,
            input_file_id=f.id,
            completion_window=parsed.window,
            metadata=parsed.metadata,
            min_discount=parsed.min_discount,
            errors=None,
            request_count=f.line_count,
            max_cost=max_cost,
            created_at=now,
            expires_at=now + FILE_WINDOWS[parsed.window],
            in_progress_at=now,
        )

        def failed(errors: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
            """Written failed, holding and charging nothing."""
            text = json.dumps(errors)
            ended = dataclasses.replace(
                row, status="failed", errors=text, failed_at=now, in_progress_at=None, **more
            )
            store.create_batch(conn, ended)
            webhook_deliveries.batch_ended(conn, batch_id, now)
            return load_file_view(conn, principal.org_id, batch_id)

        if invalid:
            # OpenAI's order: the file uploaded, the batch fails its validation, naming
            # every invalid line; as OpenAI's, such a batch ran no request.
            return failed(invalid, request_count=0)
        try:
            res = billing.reserve(
                conn,
                principal.org_id,
                max_cost,
                now,
                purpose="file_batch",
                ref=batch_id,
                tiers=svc.settings.tiers,
                savepoint=True,
                key_id=principal.key_id,
            )
        except InsufficientCredit as exc:
            error = {
                "code": exc.code,
                "message": (
                    f"{exc}"
                    if isinstance(exc, SpendCapExceeded)
                    else f"the batch can cost up to ${format_money(max_cost)} ({f.line_count} "
                    f"requests priced with each model's tokenizer) and the credit available is "
                    f"${exc.details.get('available')}; top up and create it again. Nothing was "
                    "held or charged."
                ),
                "param": None,
                "line": None,
            }
            return failed([error])
        # A retry that will run is linked both ways; one that failed for want of
        # credit runs nothing, and the batch it retried may be retried again.
        if retry_of is not None and not store.link_retry(conn, retry_of, batch_id):
            raise InvalidState(
                f"batch {retry_of} was already retried; retry that batch instead",
                code="already_retried",
            )
        store.create_batch(conn, dataclasses.replace(row, retry_of=retry_of, reservation_id=res.id))
        return load_file_view(conn, principal.org_id, batch_id)

    view = await svc.db.transact(tx)
    log.info(
        "file batch created",
        extra={
            "event": "file_batch_created",
            "batch_id": batch_id,
            "org_id": principal.org_id,
            "status": view["status"],
            "requests": view["request_counts"]["total"],
        },
    )
    return view


async def finished(
    svc: Service,
    principal: Principal,
    batch_id: str,
    *,
    after: int,
    limit: int,
    render: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The lines that ended after ``after``, as the output and error files show them
    (``render``: rewritten for another dialect, a Message Batch's result lines)."""
    sealer = svc.batch_key.require()

    def read(conn: Connection) -> dict[str, Any]:
        row = file_batch(conn, principal.org_id, batch_id, principal.own_key)
        items = following.file_batch_items(
            conn, sealer, row.id, after=after, limit=limit, render=render
        )
        return following.page(items, after=after, limit=limit, ended=row.status in ENDED)

    return await svc.db.read(read)


#: The line states a retry sends again: the call failed, or it was never sent.
RETRIED = ("failed", "expired", "canceled")
#: The most ``uncertain`` lines a retry names one by one.
MAX_NAMED = 1000


async def retry(svc: Service, principal: Principal, batch_id: str) -> dict[str, Any]:
    """A new batch of an ended batch's failed, expired and canceled lines, quoted and held.

    The lines keep their ``custom_id`` and body, copied into a new input file
    (re-sealed under its id); lines that succeeded are never sent again, nor
    are ``uncertain`` ones (their call may have been answered upstream): the
    answer names those one by one. The two batches name each other.
    """
    sealer = svc.batch_key.require()
    now = svc.clock.now()
    file_id = new_id("file", now)

    def copy(conn: Connection) -> tuple[store.BatchRow, int, list[str], int]:
        row = file_batch(conn, principal.org_id, batch_id, principal.own_key)
        if row.status not in ENDED:
            raise InvalidState(
                f"batch {batch_id} is still {openai_status(row.status)}; retry it once it ends",
                code="batch_not_ended",
            )
        if row.retried_by is not None:
            raise InvalidState(
                f"batch {batch_id} was already retried by {row.retried_by}; retry that batch "
                "instead",
                code="already_retried",
            )
        picked = store.lines_in_states(conn, row, (*RETRIED, "uncertain", "succeeded"))
        again = [line for line, state in picked if state in RETRIED]
        uncertain = [line.custom_id for line, state in picked if state == "uncertain"]
        succeeded = sum(1 for _, state in picked if state == "succeeded")
        if not again:
            raise InvalidState(
                f"batch {batch_id} has no failed, expired or canceled line to retry",
                code="nothing_to_retry",
            )
        copies, size = [], 0
        for n, line in enumerate(again, start=1):
            body = sealer.open(line.body, line_aad(row.input_file_id, line.line))
            size += len(body) + 1
            sealed = sealer.seal(body, line_aad(file_id, n))
            copies.append(dataclasses.replace(line, line=n, body=sealed))
        file_store.create_file(
            conn,
            file_id=file_id,
            org_id=principal.org_id,
            purpose="batch",
            filename=f"retry-of-{batch_id}.jsonl",
            now=now,
            key_id=principal.key_id,
        )
        file_store.write_lines(conn, file_id, copies)
        file_store.mark_processed(
            conn, file_id, size=size, line_count=len(copies), endpoint=row.endpoint
        )
        return row, len(copies), uncertain, succeeded

    row, count, uncertain, succeeded = await svc.db.transact(copy)
    parsed = Creation(
        file_id, row.endpoint, row.completion_window, row.metadata or None, row.min_discount or None
    )
    try:
        view = await create(svc, principal, parsed, retry_of=batch_id)
    except BaseException:
        await svc.db.transact(lambda c: file_store.forget(c, file_id))
        raise
    view["retry"] = {
        "of": batch_id,
        "lines": count,
        "not_retried": {
            "succeeded": succeeded,
            "uncertain": len(uncertain),
            "uncertain_custom_ids": uncertain[:MAX_NAMED],
        },
    }
    return view


async def cancel(svc: Service, principal: Principal, batch_id: str) -> dict[str, Any]:
    """Stop a batch: lines not yet sent are canceled, calls in flight may finish."""
    now = svc.clock.now()

    def tx(conn: Connection) -> dict[str, Any]:
        row = file_batch(conn, principal.org_id, batch_id, principal.own_key, lock=True)
        if row.status in (*ENDED, "finalizing"):
            raise InvalidState(
                f"batch {batch_id} is already {openai_status(row.status)}; nothing to cancel",
                code="batch_not_cancellable",
            )
        if row.status != "canceling":
            store.set_status(conn, row.id, "canceling", expect=("in_progress",), cancelling_at=now)
        return load_file_view(conn, principal.org_id, batch_id)

    view = await svc.db.transact(tx)
    log.info("file batch canceling", extra={"event": "file_batch_cancel", "batch_id": batch_id})
    return view
