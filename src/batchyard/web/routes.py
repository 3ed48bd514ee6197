"""The Batches workspace: server-rendered pages over the deferred-batch API.

Every page is plain HTML from Jinja2 with autoescaping on; there is no
script at all (a non-terminal batch refreshes with ``<meta refresh>``), so
the Content-Security-Policy can forbid scripts outright. Pages read the
store through the same queries as ``/v1/batches`` and change it only
through ``service.deferred_batches``, the functions the API calls too, so the
workspace cannot queue, cancel or show anything the API would not.

Sign-in takes an API key once and leaves a sealed, expiring cookie that
names the key's ID, never the key (``web.sessions``), so it survives a
restart and works across API processes. Forms carry a CSRF token: the sign-in form a
double-submit token also set as a cookie, the others the session's token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.ids import is_id
from batchyard.errors import BatchyardError, InvalidRequest, NotFound, PayloadTooLarge
from batchyard.service import deferred_batches as service_batches
from batchyard.service import service_of
from batchyard.service.access import SESSION
from batchyard.service.batch_requests import MAX_BODY_BYTES
from batchyard.service.batch_views import file_batch_view
from batchyard.store import accounts
from batchyard.store import deferred_batches as store
from batchyard.store import file_batches as file_store
from batchyard.store.deferred_batch_tables import ITEM_STATES
from batchyard.web.sessions import Session, Sessions, principal_of, same_token
from batchyard.web.submission import EXAMPLE, submit_text
from batchyard.work.batch_key import result_aad

__all__ = [
    "SECURITY_HEADERS",
    "error_of",
    "forbidden",
    "form",
    "page",
    "redirect",
    "router",
    "signed_in_or_redirect",
]

router = APIRouter(prefix="/workspace", include_in_schema=False)
log = logging.getLogger("batchyard.web")

SESSION_COOKIE = "by_workspace"
SIGNIN_COOKIE = "by_workspace_signin"
COOKIE_PATH = "/workspace"
#: A form is URL-encoded, which can triple the JSON it carries.
FORM_LIMIT = 3 * MAX_BODY_BYTES + 4096
PAGE_SIZE = 50
REFRESH_S = 15
LIVE_STATES = ("in_progress", "canceling")

_HERE = Path(__file__).parent
_env = Environment(
    loader=FileSystemLoader(_HERE / "templates"), autoescape=True, undefined=StrictUndefined
)
_CSS = (_HERE / "static" / "workspace.css").read_bytes()

_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _answer_text(result: dict[str, Any]) -> str:
    """A deferred item's answer as the page shows it: the reply, or the error's message."""
    body = result.get("body") or {}
    choices = body.get("choices") or []
    if choices:
        return str(choices[0].get("message", {}).get("content", ""))
    error = body.get("error") or {}
    return f"{error.get('code', 'error')}: {error.get('message', '')}"


def _when(value: datetime | None) -> str:
    return isoformat(value) if value is not None else "—"


def _unix_when(value: int | None) -> str:
    """A wire view's Unix seconds (OpenAI's shape) as the page shows every time."""
    return _when(datetime.fromtimestamp(value, UTC) if value is not None else None)


def _percent(value: Decimal) -> str:
    return f"{value.normalize():f}"


_env.filters["when"] = _when
_env.filters["unix_when"] = _unix_when
_env.filters["percent"] = _percent


# --- plumbing -----------------------------------------------------------------------


def _sessions(request: Request) -> Sessions:
    """Sealed cookies under the batch key: 503 ``batches_unavailable`` without one."""
    svc = service_of(request)
    return Sessions(svc.clock, svc.batch_key.require())


def _page(name: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = _env.get_template(name).render(**context)
    return HTMLResponse(html, status_code=status, headers=_SECURITY_HEADERS)


def _error(exc: BatchyardError) -> dict[str, Any]:
    """What a page shows of an error: exactly the API's code and message."""
    return {"code": exc.code, "message": exc.message, "status": exc.status}


def _set_cookie(response: Response, request: Request, name: str, value: str) -> None:
    response.set_cookie(
        name,
        value,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _redirect(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303, headers=_SECURITY_HEADERS)


def _to_signin(note: str | None = None) -> RedirectResponse:
    response = _redirect("/workspace/" + (f"?note={note}" if note else ""))
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH)
    return response


async def _form(request: Request) -> dict[str, str]:
    """The URL-encoded form, size-capped; the last value of a repeated field wins.

    Anything else (no body, ``text/plain`` from a cross-site form) reads as an
    empty form, so it fails the CSRF check with 403 like any tokenless post.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        return {}
    size = 0
    chunks: list[bytes] = []
    async for chunk in request.stream():
        size += len(chunk)
        if size > FORM_LIMIT:
            raise PayloadTooLarge(f"the form is over {FORM_LIMIT} bytes")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=16)
    except (UnicodeDecodeError, ValueError):
        raise InvalidRequest("the form could not be read") from None
    return dict(pairs)


async def _signed_in(request: Request) -> tuple[Session, Principal] | None:
    token = request.cookies.get(SESSION_COOKIE)
    sessions = _sessions(request)
    session = sessions.get(token)
    if session is None:
        return None
    svc = service_of(request)
    principal = await svc.db.read(lambda c: principal_of(c, session))
    if principal is None:
        return None
    if principal.scope in SESSION.own_only:
        principal = dataclasses.replace(principal, own_only=True)
    return session, principal


async def signed_in_or_redirect(request: Request) -> tuple[Session, Principal] | Response:
    """The signed-in caller, or the redirect to the sign-in page that a page answers instead."""
    who = await _signed_in(request)
    if who is None:
        return _to_signin("ended" if request.cookies.get(SESSION_COOKIE) else None)
    return who


def _forbidden(reason: str) -> HTMLResponse:
    log.info("workspace form refused", extra={"event": "workspace_csrf", "reason": reason})
    error = {"code": "csrf_failed", "message": reason, "status": 403}
    return _page("error.html", 403, error=error, signed_in=False)


# What the file-batch pages (``web.file_pages``) share with these.
SECURITY_HEADERS = _SECURITY_HEADERS
error_of = _error
forbidden = _forbidden
form = _form
page = _page
redirect = _redirect


# --- sign-in ------------------------------------------------------------------------


def _signin_page(request: Request, *, status: int = 200, error: Any = None) -> HTMLResponse:
    token = secrets.token_urlsafe(32)
    notes = {"ended": "Your session ended; sign in again.", "out": "You are signed out."}
    note = notes.get(request.query_params.get("note", ""))
    response = _page("signin.html", status, csrf=token, error=error, note=note, signed_in=False)
    _set_cookie(response, request, SIGNIN_COOKIE, token)
    return response


@router.get("/")
async def signin_form(request: Request) -> Response:
    if await _signed_in(request) is not None:
        return _redirect("/workspace/batches")
    return _signin_page(request)


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    form = await _form(request)
    if not same_token(request.cookies.get(SIGNIN_COOKIE, ""), form.get("csrf")):
        return _forbidden("the sign-in form has expired or did not come from this site; reload")
    secret = form.get("api_key", "").strip()
    svc = service_of(request)
    principal = await svc.db.read(lambda c: accounts.authenticate(c, secret))
    if principal is None:
        error = {"code": "invalid_api_key", "message": "the API key is not valid", "status": 401}
        return _signin_page(request, status=401, error=error)
    if principal.scope not in SESSION.scopes:
        error = {
            "code": "insufficient_scope",
            "message": f"the workspace needs a key with scope full or inference; "
            f"this key has scope {principal.scope.value}",
            "status": 403,
        }
        return _signin_page(request, status=403, error=error)
    token, _ = _sessions(request).open(principal)
    log.info(
        "workspace sign-in",
        extra={
            "event": "workspace_sign_in",
            "org_id": principal.org_id,
            "key_id": principal.key_id,
        },
    )
    response = _redirect("/workspace/batches")
    _set_cookie(response, request, SESSION_COOKIE, token)
    response.delete_cookie(SIGNIN_COOKIE, path=COOKIE_PATH)
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    who = await _signed_in(request)
    if who is None:
        return _to_signin()
    form = await _form(request)
    if not same_token(who[0].csrf, form.get("csrf")):
        return _forbidden("the form did not carry this session's token; reload and retry")
    sessions = _sessions(request)
    await service_of(request).db.transact(lambda c: sessions.close(c, who[0]))
    return _to_signin("out")


# --- batches ------------------------------------------------------------------------


def _new_key() -> str:
    return "ws-" + secrets.token_urlsafe(24)


async def _list_page(
    request: Request,
    session: Session,
    principal: Principal,
    *,
    status: int = 200,
    error: Any = None,
    body_text: str | None = None,
) -> HTMLResponse:
    svc = service_of(request)
    after = request.query_params.get("after") or None
    if after is not None and not is_id(after, "bat"):
        after = None  # not a cursor this page gave out: start from the newest

    def load(
        conn: Connection,
    ) -> tuple[list[store.DeferredBatchRow], dict[str, dict[str, int]], list[dict[str, Any]]]:
        own = principal.key_id if principal.own_only else None
        org = principal.org_id
        rows = store.list_batches(conn, org, after=after, limit=PAGE_SIZE, key_id=own)
        filed = file_store.list_batches(conn, org, after=None, limit=PAGE_SIZE, key_id=own)
        totals = file_store.totals(conn, [b.id for b in filed])
        views = [file_batch_view(b, totals[b.id]) for b in filed]
        return rows, store.counts(conn, [b.id for b in rows]), views

    rows, per, file_batches = await svc.db.read(load)
    return _page(
        "batches.html",
        status,
        signed_in=True,
        org_name=principal.org_name,
        csrf=session.csrf,
        batches=[(b, per[b.id]) for b in rows],
        file_batches=file_batches,
        next_after=rows[-1].id if len(rows) == PAGE_SIZE else None,
        body_text=body_text if body_text is not None else json.dumps(EXAMPLE, indent=2),
        idempotency_key=_new_key(),
        error=error,
        states=ITEM_STATES,
    )


@router.get("/batches")
async def batches_page(request: Request) -> Response:
    who = await _signed_in(request)
    if who is None:
        return _to_signin("ended" if request.cookies.get(SESSION_COOKIE) else None)
    return await _list_page(request, *who)


@router.post("/batches")
async def submit_batch(request: Request) -> Response:
    who = await _signed_in(request)
    if who is None:
        return _to_signin("ended")
    session, principal = who
    form = await _form(request)
    if not same_token(session.csrf, form.get("csrf")):
        return _forbidden("the form did not carry this session's token; reload and retry")
    text = form.get("body", "")
    try:
        outcome = await submit_text(
            service_of(request), principal, text, form.get("idempotency_key", "")
        )
    except BatchyardError as exc:
        return await _list_page(
            request, session, principal, status=exc.status, error=_error(exc), body_text=text
        )
    if outcome.status >= 400:
        saved = outcome.body.get("error", {})
        error = {
            "code": saved.get("code"),
            "message": saved.get("message"),
            "status": outcome.status,
        }
        return await _list_page(
            request, session, principal, status=outcome.status, error=error, body_text=text
        )
    return _redirect(f"/workspace/batches/{outcome.body['id']}")


@router.get("/batches/{batch_id}")
async def batch_page(request: Request, batch_id: str) -> Response:
    who = await _signed_in(request)
    if who is None:
        return _to_signin("ended" if request.cookies.get(SESSION_COOKIE) else None)
    return await _batch_page(request, *who, batch_id)


async def _batch_page(
    request: Request,
    session: Session,
    principal: Principal,
    batch_id: str,
    *,
    status: int = 200,
    error: Any = None,
) -> HTMLResponse:
    svc = service_of(request)

    def load(
        conn: Connection,
    ) -> (
        tuple[store.DeferredBatchRow, dict[str, int], list[store.ItemRow], dict[str, bytes]] | None
    ):
        own = principal.key_id if principal.own_only else None
        batch = store.get_batch(conn, principal.org_id, batch_id, key_id=own)
        if batch is None:
            return None
        results = {item.id: blob for item, blob in store.results_of(conn, batch.id) if blob}
        counts = store.counts(conn, [batch.id])[batch.id]
        return batch, counts, store.items_of(conn, batch.id), results

    found = await svc.db.read(load) if is_id(batch_id, "bat") else None
    if found is None:
        missing = NotFound(f"batch {batch_id} not found", param="batch_id")
        return _page("error.html", 404, error=_error(missing), signed_in=True, csrf=session.csrf)
    batch, counts, items, results = found
    live = batch.status in LIVE_STATES
    sealer = svc.batch_key.require()
    answers = {
        item_id: _answer_text(json.loads(sealer.open(blob, result_aad(item_id))))
        for item_id, blob in results.items()
    }
    return _page(
        "batch.html",
        status,
        signed_in=True,
        org_name=principal.org_name,
        csrf=session.csrf,
        batch=batch,
        counts=counts,
        items=items,
        answers=answers,
        states=ITEM_STATES,
        refresh_s=REFRESH_S if live else None,
        can_cancel=batch.status not in ("completed", "expired", "canceled"),
        error=error,
    )


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    who = await _signed_in(request)
    if who is None:
        return _to_signin("ended")
    session, principal = who
    form = await _form(request)
    if not same_token(session.csrf, form.get("csrf")):
        return _forbidden("the form did not carry this session's token; reload and retry")
    try:
        await service_batches.cancel(service_of(request), principal, batch_id)
    except BatchyardError as exc:
        return await _batch_page(
            request, session, principal, batch_id, status=exc.status, error=_error(exc)
        )
    return _redirect(f"/workspace/batches/{batch_id}")


@router.get("/batches/{batch_id}/results")
async def download_results(request: Request, batch_id: str) -> Response:
    who = await _signed_in(request)
    if who is None:
        return _to_signin("ended" if request.cookies.get(SESSION_COOKIE) else None)
    session, principal = who
    try:
        lines = await service_batches.result_lines(service_of(request), principal, batch_id)
    except BatchyardError as exc:
        return _page("error.html", exc.status, error=_error(exc), signed_in=True, csrf=session.csrf)
    disposition = f'attachment; filename="{batch_id}-results.ndjson"'
    headers = {**_SECURITY_HEADERS, "Content-Disposition": disposition}
    return StreamingResponse(lines, media_type="application/x-ndjson", headers=headers)


@router.get("/static/workspace.css")
async def stylesheet() -> Response:
    return Response(_CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})
