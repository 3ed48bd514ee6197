"""The workspace's file batches: upload a JSONL file, follow it, read its answers, download.

A file batch is created from the page exactly as through the API: the upload
streams to disk (``service.uploads``) and is checked and stored line by line
(``service.files.ingest``), then ``service.file_batches.create`` prices the
whole file and holds the quote. The batch page shows its progress and cost,
every line's answer (or error) in the page, a page of lines at a time, and
links to download the output and error files. Nothing here decides anything
the API would not: the pages call the same service functions.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.ids import is_id
from batchyard.errors import BatchyardError, InvalidRequest, NotFound
from batchyard.service import file_batches, files, service_of
from batchyard.service.batch_views import load_file_view, openai_status
from batchyard.service.openai_requests import ENDPOINTS
from batchyard.service.uploads import read_multipart
from batchyard.store import file_batches as fstore
from batchyard.web.routes import (
    SECURITY_HEADERS,
    error_of,
    forbidden,
    form,
    page,
    redirect,
    signed_in_or_redirect,
)
from batchyard.web.sessions import Session, same_token

__all__ = ["router"]

router = APIRouter(prefix="/workspace", include_in_schema=False)

LINES_PER_PAGE = 50
REFRESH_S = 5
#: The live statuses as the page's batch object (OpenAI's view) spells them.
LIVE = tuple(openai_status(status) for status in fstore.LIVE)


def _answer(sealed: bytes | None, opener: Any, batch_id: str, line: int) -> dict[str, Any]:
    """What the page shows of a line: its answer text, or its error code and message."""
    if sealed is None:
        return {"text": None, "code": None, "status": None}
    out = json.loads(opener(sealed, fstore.out_aad(batch_id, line)))
    response = out.get("response")
    if out.get("error"):
        return {"text": out["error"]["message"], "code": out["error"]["code"], "status": None}
    body = response.get("body") or {}
    if response.get("status_code") != 200:
        err = body.get("error", {})
        status = response["status_code"]
        return {"text": err.get("message"), "code": err.get("code"), "status": status}
    choices = body.get("choices") or []
    text = choices[0].get("message", {}).get("content") if choices else json.dumps(body)[:500]
    return {"text": text, "code": None, "status": 200}


@router.post("/files")
async def upload_and_create(request: Request) -> Response:
    """Upload the form's file and create a batch over it; then its page."""
    who = await signed_in_or_redirect(request)
    if isinstance(who, Response):
        return who
    session, principal = who
    svc = service_of(request)
    try:
        upload = await read_multipart(
            request.stream(),
            request.headers.get("content-type"),
            file_field="file",
            fields=("csrf", "completion_window", "min_discount"),
            max_file_bytes=files.settings_of(svc).max_bytes,
        )
    except BatchyardError as exc:
        return _failed(request, session, exc)
    try:
        if not same_token(session.csrf, upload.fields.get("csrf")):
            return forbidden("the form did not carry this session's token; reload and retry")
        if upload.file is None or upload.size == 0:
            raise InvalidRequest("choose a JSONL file to upload", param="file")
        view = await files.ingest_upload(svc, principal, upload, purpose="batch")
        body: dict[str, Any] = {
            "input_file_id": view["id"],
            # No valid line names one: the batch fails, listing every line's error.
            "endpoint": view["endpoint"] or ENDPOINTS[0],
            "completion_window": upload.fields.get("completion_window", "24h"),
        }
        if upload.fields.get("min_discount"):
            body["metadata"] = {"min_discount": upload.fields["min_discount"]}
        batch = await file_batches.create(svc, principal, file_batches.parse_create(body))
        svc.file_batches.notify()
    except BatchyardError as exc:
        return _failed(request, session, exc)
    finally:
        upload.close()
    return redirect(f"/workspace/file-batches/{batch['id']}")


def _failed(request: Request, session: Session, exc: BatchyardError) -> HTMLResponse:
    return page("error.html", exc.status, error=error_of(exc), signed_in=True, csrf=session.csrf)


@router.get("/file-batches/{batch_id}")
async def file_batch_page(request: Request, batch_id: str) -> Response:
    who = await signed_in_or_redirect(request)
    if isinstance(who, Response):
        return who
    return await _batch_page(request, *who, batch_id)


async def _batch_page(
    request: Request, session: Session, principal: Principal, batch_id: str
) -> HTMLResponse:
    svc = service_of(request)
    raw_after = request.query_params.get("after", "0")
    after = int(raw_after) if raw_after.isascii() and raw_after.isdigit() else 0
    after = min(after, 2**31 - 1)
    own = principal.key_id if principal.own_only else None

    def load(c: Connection) -> tuple[dict[str, Any], list[Any]] | None:
        if fstore.get_batch(c, principal.org_id, batch_id, key_id=own) is None:
            return None
        view = load_file_view(c, principal.org_id, batch_id, key_id=own)
        return view, fstore.page_lines(c, batch_id, after=after, limit=LINES_PER_PAGE)

    # An ID that can name nothing is not looked up (a NUL would trouble PostgreSQL).
    found = await svc.db.read(load) if is_id(batch_id, "bat") else None
    if found is None:
        missing = NotFound(f"batch {batch_id} not found", param="batch_id")
        return page("error.html", 404, error=error_of(missing), signed_in=True, csrf=session.csrf)
    view, rows = found
    sealer = svc.batch_key.require()
    lines = [
        {"line": n, "custom_id": cid, "state": state, **_answer(out, sealer.open, batch_id, n)}
        for n, cid, state, out in rows
    ]
    counts = view["request_counts"]
    ended = sum(counts[k] for k in ("succeeded", "failed", "expired", "canceled", "uncertain"))
    return page(
        "file_batch.html",
        signed_in=True,
        org_name=principal.org_name,
        csrf=session.csrf,
        batch=view,
        ended=ended,
        percent=round(100 * ended / counts["total"]) if counts["total"] else 100,
        lines=lines,
        next_after=rows[-1][0] if len(rows) == LINES_PER_PAGE else None,
        refresh_s=REFRESH_S if view["status"] in LIVE else None,
        can_cancel=view["status"] == "in_progress",
        error=None,
    )


@router.post("/file-batches/{batch_id}/cancel")
async def cancel_file_batch(request: Request, batch_id: str) -> Response:
    who = await signed_in_or_redirect(request)
    if isinstance(who, Response):
        return who
    session, principal = who
    if not same_token(session.csrf, (await form(request)).get("csrf")):
        return forbidden("the form did not carry this session's token; reload and retry")
    svc = service_of(request)
    try:
        if not is_id(batch_id, "bat"):
            raise NotFound(f"batch {batch_id!r} not found", param="batch_id")
        await file_batches.cancel(svc, principal, batch_id)
    except BatchyardError as exc:
        return _failed(request, session, exc)
    svc.file_batches.notify()
    return redirect(f"/workspace/file-batches/{batch_id}")


@router.get("/files/{file_id}/content")
async def download_file(request: Request, file_id: str) -> Response:
    who = await signed_in_or_redirect(request)
    if isinstance(who, Response):
        return who
    session, principal = who
    svc = service_of(request)
    try:
        if not is_id(file_id, "file"):
            raise NotFound(f"file {file_id!r} not found", param="file_id", code="file_not_found")
        meta = await files.get(svc, principal, file_id)
        chunks = await files.content(svc, principal, file_id)
    except BatchyardError as exc:
        return _failed(request, session, exc)
    name = "".join(ch for ch in meta["filename"] if ch.isalnum() or ch in "._-") or "file.jsonl"
    headers = {**SECURITY_HEADERS, "Content-Disposition": f'attachment; filename="{name}"'}
    return StreamingResponse(chunks, media_type="application/jsonl", headers=headers)
