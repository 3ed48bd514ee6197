"""Files as both front doors use them: take in an upload, show, list, read, delete.

``ingest`` reads an upload line by line on a thread, in bounded memory: each line is
checked whole (``service.openai_requests``), has privacy applied, is counted and sealed,
under a file that stays invisible until its last line is in. As OpenAI does, an upload
takes any file of lines: a line that is not a valid request is kept with its error, and a
batch made from the file fails naming it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from typing import IO, Any, TypeVar

from sqlalchemy import Connection

from batchyard.core import privacy
from batchyard.core.accounts import Principal
from batchyard.core.ids import new_id
from batchyard.core.inputs import parse_json
from batchyard.core.sections import FileSettings
from batchyard.errors import BatchyardError, Conflict, InvalidRequest, NotFound, PayloadTooLarge
from batchyard.service.batch_views import ts
from batchyard.service.deployment import Service
from batchyard.service.openai_requests import Rules, validate_line
from batchyard.service.uploads import Upload
from batchyard.store import file_batches as batch_store
from batchyard.store import files as store
from batchyard.store.file_batches import out_aad
from batchyard.store.files import line_aad

__all__ = [
    "PURPOSES",
    "content",
    "delete",
    "file_view",
    "first",
    "get",
    "ingest",
    "ingest_upload",
    "list_views",
    "pages",
    "rules_of",
    "settings_of",
]

log = logging.getLogger("batchyard.files")

T = TypeVar("T")

#: What a caller may upload; ``batch_output`` files are batchyard's own.
PURPOSES = ("batch",)
#: Lines written per transaction while an upload is taken in.
WRITE_BATCH = 500
#: Lines read per page of a file's content.
PAGE = 1000
_LINE_KEYS = {"custom_id", "method", "url", "body"}


def settings_of(svc: Service) -> FileSettings:
    return svc.settings.files


def rules_of(svc: Service, org_id: str | None = None) -> Rules:
    """The line rules of this deployment: its catalog, tokenizers and privacy default."""
    mode = privacy.PrivacyMode(svc.settings.privacy_default)
    return Rules(preparer=svc.preparer, privacy_default=mode, org_id=org_id)


def file_view(f: store.FileRow) -> dict[str, Any]:
    """OpenAI's File object (``status`` is its deprecated field, always ``processed``)."""
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": ts(f.created_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": ts(f.expires_at),
        # batchyard's own: what the file holds.
        "lines": f.line_count,
        "endpoint": f.endpoint,
    }


def _at_line(n: int, exc: BatchyardError) -> BatchyardError:
    """The same error about a line's body, its message and param naming the line."""
    inner = exc.param if exc.param in ("url", "body") else f"body.{exc.param or ''}".rstrip(".")
    param = f"line {n}: {inner}"
    return type(exc)(
        f"line {n}: {exc.message}",
        param=param,
        code=exc.code,
        status=exc.status,
        details={**exc.details, "line": n},
    )


def _bad(n: int, message: str, code: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(
        f"line {n}: {message}",
        param=f"line {n}" + (f": {param}" if param else ""),
        code=code,
        details={"line": n},
    )


def _lines(f: IO[bytes], limits: FileSettings) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every non-blank line, each read with a bounded buffer."""
    n = 0
    while True:
        raw = f.readline(limits.max_line_bytes + 2)
        if not raw:
            return
        n += 1
        if len(raw) > limits.max_line_bytes and not raw.endswith(b"\n"):
            raise PayloadTooLarge(
                f"line {n} is over {limits.max_line_bytes} bytes",
                code="line_too_large",
                details={"line": n},
            )
        line = raw.rstrip(b"\r\n")
        if line.strip():
            yield n, line


def _parse(n: int, raw: bytes) -> Any:
    """One line as JSON; one that is not is an invalid line like any other (OpenAI's order)."""
    try:
        # Strict JSON, as every body: no NaN, lone surrogate, NUL or deep nesting.
        return parse_json(raw, "the line", request=True)
    except BatchyardError as exc:
        raise _bad(n, exc.message, exc.code) from None


def _invalid(
    n: int, obj: Any, raw: bytes, exc: BatchyardError, limits: FileSettings
) -> tuple[str, bytes]:
    """A line that is no valid request: its custom_id, and what is sealed for it.

    What is kept is the error (OpenAI's ``errors.data`` item) and the line as sent, so
    the file's content reads back as uploaded (a line that is not UTF-8, in base64); a
    line refused by privacy ``reject`` is not kept at all, only its error.
    """
    # The line is a field of its own here: the param is the field within the line.
    param = exc.param
    if param is not None and param.startswith(f"line {n}"):
        param = param.partition(": ")[2] or None
    error = {"code": exc.code, "line": n, "message": exc.message, "param": param}
    stored: dict[str, Any] = {"error": error, "line": None}
    if exc.code != "privacy_rejected":
        try:
            stored["line"] = raw.decode("utf-8")
        except UnicodeDecodeError:
            stored["line_base64"] = base64.b64encode(raw).decode("ascii")
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    custom_id = cid[: limits.max_custom_id] if isinstance(cid, str) else ""
    return custom_id, json.dumps(stored, ensure_ascii=False).encode()


def _check(
    n: int,
    obj: Any,
    raw: bytes,
    rules: Rules,
    limits: FileSettings,
    seen: set[bytes],
    endpoint: str | None,
) -> tuple[str, str, Any, bytes]:
    """One line checked: (custom_id, url, checked body, the line as it will be stored)."""
    if not isinstance(obj, dict):
        raise _bad(n, "each line must be a JSON object", "invalid_json")
    for key in sorted(obj.keys() - _LINE_KEYS):
        raise _bad(n, f"{key} is not a field of a batch line", "unsupported_parameter", param=key)
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > limits.max_custom_id:
        raise _bad(
            n,
            f"custom_id must be a string of 1 to {limits.max_custom_id} characters",
            "invalid_custom_id",
            param="custom_id",
        )
    digest = hashlib.blake2b(cid.encode(), digest_size=16).digest()
    if digest in seen:
        raise _bad(
            n, f"custom_id {cid!r} appears more than once", "duplicate_custom_id", "custom_id"
        )
    seen.add(digest)
    if obj.get("method") != "POST":
        raise _bad(n, "method must be POST", "invalid_method", param="method")
    url = obj.get("url")
    if not isinstance(url, str):
        raise _bad(n, "url must be an endpoint path", "unsupported_endpoint", param="url")
    if endpoint is not None and url != endpoint:
        raise _bad(
            n,
            f"url {url!r} differs from {endpoint!r} on the lines before it; a batch file "
            "names one endpoint",
            "mixed_endpoints",
            param="url",
        )
    try:
        checked = validate_line(url, obj.get("body"), rules)
    except BatchyardError as exc:
        raise _at_line(n, exc) from None
    body = obj["body"]
    if checked.body == body:
        stored = raw  # unchanged: kept byte for byte
    else:
        obj["body"] = checked.body
        stored = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return cid, url, checked, stored


def ingest(
    svc: Service,
    principal: Principal,
    f: IO[bytes],
    *,
    filename: str,
    purpose: str,
    expires_after_s: int | None = None,
    strict: bool = False,
) -> dict[str, Any]:
    """Take in an uploaded batch file whole, or nothing of it (runs on a thread).

    A line that is JSON but not a valid request is kept (OpenAI's order: the batch
    made from the file fails, naming it); ``strict`` refuses the whole file on it
    instead, for a door that validates at submission (Anthropic's Message Batches).
    """
    sealer = svc.batch_key.require()
    limits = settings_of(svc)
    rules = rules_of(svc, principal.org_id)
    now = svc.clock.now()
    file_id = new_id("file", now)
    expires_at = now + timedelta(seconds=expires_after_s) if expires_after_s else None
    svc.db.transact_sync(
        lambda c: store.create_file(
            c,
            file_id=file_id,
            org_id=principal.org_id,
            purpose=purpose,
            filename=filename,
            now=now,
            expires_at=expires_at,
            key_id=principal.key_id,
        )
    )
    seen: set[bytes] = set()
    endpoint: str | None = None
    count = size = redactions = invalid = 0
    pending: list[store.LineRow] = []
    try:
        for n, raw in _lines(f, limits):
            count += 1
            if count > limits.max_lines:
                raise InvalidRequest(
                    f"a batch file holds at most {limits.max_lines} requests; line {n} is "
                    f"request {count}",
                    code="too_many_lines",
                    details={"line": n, "limit": limits.max_lines},
                )
            obj = None
            try:
                obj = _parse(n, raw)
                cid, url, checked, stored = _check(n, obj, raw, rules, limits, seen, endpoint)
            except BatchyardError as exc:
                if strict:
                    raise
                # Kept: creating a batch from this file fails it, naming this line.
                invalid += 1
                cid, stored = _invalid(n, obj, raw, exc, limits)
                size += len(raw) + 1
                model, tokens = store.INVALID_LINE, (0, 0)
            else:
                endpoint = url
                redactions += checked.redactions
                size += len(stored) + 1
                model, tokens = checked.model.id, (checked.input_tokens, checked.max_output_tokens)
            sealed = sealer.seal(stored, line_aad(file_id, n))
            pending.append(store.LineRow(n, cid, model, *tokens, sealed))
            if len(pending) >= WRITE_BATCH:
                svc.db.transact_sync(partial(store.write_lines, file_id=file_id, lines=pending))
                pending = []
        if count == 0:
            raise InvalidRequest(
                "the file holds no requests; send one JSON object a line", code="empty_file"
            )

        def finish(c: Connection) -> store.FileRow:
            store.write_lines(c, file_id, pending)
            store.mark_processed(c, file_id, size=size, line_count=count, endpoint=endpoint)
            row = store.get_file(c, principal.org_id, file_id)
            assert row is not None
            return row

        row = svc.db.transact_sync(finish)
    except BaseException:
        svc.db.transact_sync(lambda c: store.forget(c, file_id))
        raise
    log.info(
        "file uploaded",
        extra={
            "event": "file_uploaded",
            "file_id": file_id,
            "org_id": principal.org_id,
            "lines": count,
            "invalid_lines": invalid,
            "privacy_redactions": redactions,
        },
    )
    return file_view(row)


async def ingest_upload(
    svc: Service,
    principal: Principal,
    upload: Upload,
    *,
    purpose: str,
    expires_after_s: int | None = None,
) -> dict[str, Any]:
    """A multipart upload's file part taken in (``ingest``, on a thread), by either door."""
    if upload.file is None:
        raise InvalidRequest("the upload has no file part", param="file")
    return await asyncio.to_thread(
        ingest,
        svc,
        principal,
        upload.file,
        filename=(upload.filename or "upload.jsonl")[:255],
        purpose=purpose,
        expires_after_s=expires_after_s,
    )


def _as_sent(model: str, body: bytes) -> bytes:
    """A stored line as it was uploaded (an invalid line keeps it beside its error)."""
    if model != store.INVALID_LINE:
        return body + b"\n"
    kept = json.loads(body)
    if "line_base64" in kept:
        return base64.b64decode(kept["line_base64"]) + b"\n"
    return b"" if kept["line"] is None else kept["line"].encode("utf-8") + b"\n"


def _visible(c: Connection, principal: Principal, file_id: str) -> store.FileRow:
    row = store.get_file(c, principal.org_id, file_id, key_id=principal.own_key)
    if row is None or row.deleted_at is not None:
        raise NotFound(f"file {file_id} not found", param="file_id", code="file_not_found")
    return row


async def get(svc: Service, principal: Principal, file_id: str) -> dict[str, Any]:
    row = await svc.db.read(lambda c: _visible(c, principal, file_id))
    return file_view(row)


async def list_views(
    svc: Service,
    principal: Principal,
    *,
    after: str | None,
    limit: int,
    purpose: str | None,
    newest_first: bool,
) -> tuple[list[dict[str, Any]], bool]:
    """One page of the caller's files and whether more follow."""

    def load(c: Connection) -> list[store.FileRow]:
        return store.list_files(
            c,
            principal.org_id,
            after=after,
            limit=limit + 1,
            purpose=purpose,
            newest_first=newest_first,
            key_id=principal.own_key,
        )

    rows = await svc.db.read(load)
    return [file_view(r) for r in rows[:limit]], len(rows) > limit


async def delete(svc: Service, principal: Principal, file_id: str) -> dict[str, Any]:
    """Delete a file and its stored lines; refused while a live batch reads it."""
    now = svc.clock.now()

    def tx(c: Connection) -> None:
        row = _visible(c, principal, file_id)
        readers = batch_store.live_batch_reads(c, row.id)
        if readers:
            raise Conflict(
                f"file {file_id} is the input of batch {readers[0]}, which is still running; "
                "cancel it or wait until it ends",
                param="file_id",
                code="file_in_use",
            )
        store.mark_deleted(c, row.id, now)

    await svc.db.transact(tx)
    log.info("file deleted", extra={"event": "file_deleted", "file_id": file_id})
    return {"id": file_id, "object": "file", "deleted": True}


def first(numbered: tuple[int, bytes]) -> int:
    """The number of a ``(number, sealed)`` line."""
    return numbered[0]


def pages(
    svc: Service,
    read: Callable[..., Sequence[T]],
    number: Callable[[T], int],
    text: Callable[[Sequence[T]], bytes],
) -> AsyncIterator[bytes]:
    """Stored lines as bytes, page by page: ``read(conn, after=...)`` gives the lines after the
    last one's ``number``, and each page's ``text`` (opening sealed lines: CPU work) is made
    off the event loop."""

    async def stream() -> AsyncIterator[bytes]:
        after = 0
        while page := await svc.db.read(partial(read, after=after)):
            yield await asyncio.to_thread(text, page)
            after = number(page[-1])

    return stream()


async def content(svc: Service, principal: Principal, file_id: str) -> AsyncIterator[bytes]:
    """The file's lines in order; errors are raised before the first byte."""
    sealer = svc.batch_key.require()
    row = await svc.db.read(lambda c: _visible(c, principal, file_id))
    if row.batch_id is None:

        def sent(lines: Sequence[store.LineRow]) -> bytes:
            opened = ((ln.model, sealer.open(ln.body, line_aad(row.id, ln.line))) for ln in lines)
            return b"".join(_as_sent(model, body) for model, body in opened)

        read = partial(store.read_lines, file_id=row.id, limit=PAGE)
        return pages(svc, read, lambda ln: ln.line, sent)
    batch_id = row.batch_id

    def opened(got: Sequence[tuple[int, bytes]]) -> bytes:
        return b"".join(sealer.open(out, out_aad(batch_id, n)) for n, out in got)

    errors = row.kind == "error"
    out = partial(batch_store.output_lines, batch_id=batch_id, errors=errors, limit=PAGE)
    return pages(svc, out, first, opened)
