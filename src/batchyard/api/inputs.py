"""Reading what a client sends, strictly: bodies, query parameters and IDs.

Everything a handler reads from a request goes through here, so the rules
are the same at every door and a malformed request is a coded 400 (or 404,
413, 415) before anything is claimed, charged or written:

- a JSON body needs ``Content-Type: application/json`` (415 otherwise), and is
  parsed as strict JSON and checked against a strict shape (``core.inputs``:
  no NaN, no lone surrogates, no NUL, bounded nesting, no coercion, unknown
  fields refused by name);
- paging parameters are ASCII decimal within their range, never clamped, and
  a cursor is one this API could have given out;
- IDs in paths have their prefix and a UUIDv7, or are 404 at once (they name
  nothing); row IDs are ASCII decimal within the column's range.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import Request

from batchyard.core.ids import is_id
from batchyard.core.inputs import (
    MAX_DEPTH,
    Shape,
    check_document,
    parse_json,
    printable,
    strict,
)
from batchyard.errors import (
    InvalidJson,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    UnknownField,
    UnsupportedMediaType,
)
from batchyard.service.deployment import service_of

__all__ = [
    "MAX_DEPTH",
    "MAX_ROW_ID",
    "Shape",
    "check_document",
    "finished_query",
    "json_content_type",
    "object_id",
    "parse_json",
    "query_cursor",
    "query_id_cursor",
    "query_limit",
    "read_body",
    "read_empty",
    "read_json",
    "row_id",
    "strict",
]

#: Row IDs are 32-bit integers in the store (PostgreSQL ``integer``).
MAX_ROW_ID = 2**31 - 1

_DIGITS = re.compile(r"[0-9]{1,10}")
_JSON_TYPE = re.compile(r"application/(?:[a-z0-9.+-]+\+)?json")


# -- bodies ---------------------------------------------------------------------


def json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (``application/json`` or ``…+json``, UTF-8)."""
    header = request.headers.get("content-type")
    if header is None:
        raise UnsupportedMediaType(
            "send the body with Content-Type: application/json", param="Content-Type"
        )
    media, _, params = header.partition(";")
    if not _JSON_TYPE.fullmatch(media.strip().lower()):
        raise UnsupportedMediaType(
            f"this call reads JSON; Content-Type {media.strip()[:60]!r} is not application/json",
            param="Content-Type",
        )
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise UnsupportedMediaType(
                "JSON bodies are UTF-8; send charset=utf-8 or no charset", param="Content-Type"
            )


async def read_body(request: Request, cap: int) -> bytes:
    """The raw body, refused with 413 as soon as it passes ``cap`` bytes."""
    declared = request.headers.get("content-length")
    if declared and _DIGITS.fullmatch(declared) and int(declared) > cap:
        raise PayloadTooLarge(f"the request body is over {cap} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise PayloadTooLarge(f"the request body is over {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, *, limit: int | None = None) -> Any:
    """The body as one strict JSON object, declared ``application/json``, size-capped."""
    json_content_type(request)
    cap = limit or service_of(request).settings.max_body_bytes
    body = parse_json(await read_body(request, cap), request=True)
    if not isinstance(body, dict):
        raise InvalidJson("the request body must be a JSON object")
    return body


async def read_empty(request: Request) -> dict[str, Any]:
    """A call that takes no body: nothing, or ``{}``; any field is refused by name."""
    raw = await read_body(request, 64 * 1024)
    if not raw.strip():
        return {}
    json_content_type(request)
    body = parse_json(raw, request=True)
    if not isinstance(body, dict):
        raise InvalidJson("this call takes no body (or an empty JSON object)")
    for key in body:
        raise UnknownField(f"this call takes no body; {key[:60]!r} is not a field", param=key)
    return body


# -- query parameters -------------------------------------------------------------


def _query(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name} is given {len(values)} times; give it once", param=name)
    return values[0] if values else None


def query_limit(request: Request, *, default: int, most: int, name: str = "limit") -> int:
    """A page size from 1 to ``most``, in ASCII digits; 400 ``invalid_limit`` otherwise."""
    raw = _query(request, name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= most:
        raise InvalidRequest(
            f"{name} must be a whole number from 1 to {most}, not {raw[:40]!r}",
            param=name,
            code="invalid_limit",
        )
    return int(raw)


def query_cursor(request: Request, *, name: str = "cursor") -> int | None:
    """A numeric cursor (a row ID this API gave out), or None; 400 ``invalid_cursor``."""
    raw = _query(request, name)
    if raw is None or raw == "":
        return None
    if not _DIGITS.fullmatch(raw) or int(raw) > MAX_ROW_ID:
        raise InvalidRequest(
            f"{name} {raw[:40]!r} is not a cursor this API gave out",
            param=name,
            code="invalid_cursor",
        )
    return int(raw)


def finished_query(request: Request) -> tuple[int, int]:
    """``after`` (a cursor a page of finished items gave, 0 from the start) and ``limit``.

    The query of every batch kind's ``/finished`` (``service.following``);
    any other parameter is refused.
    """
    for key in sorted(request.query_params.keys() - {"after", "limit"}):
        raise InvalidRequest(
            f"{key} is not a query parameter here", param=key, code="unsupported_parameter"
        )
    after = query_cursor(request, name="after") or 0
    return after, query_limit(request, default=100, most=1000)


def query_id_cursor(request: Request, prefix: str, *, name: str = "cursor") -> str | None:
    """A cursor that is an object ID (``prefix.<uuid7>``), or None; 400 ``invalid_cursor``."""
    raw = _query(request, name)
    if raw is None or raw == "":
        return None
    if not is_id(raw, prefix):
        raise InvalidRequest(
            f"{name} {raw[:80]!r} is not a cursor this API gave out",
            param=name,
            code="invalid_cursor",
        )
    return raw


# -- IDs --------------------------------------------------------------------------


def object_id(value: str, prefix: str, *, param: str, what: str, code: str | None = None) -> str:
    """An ID from a path: the right prefix and a UUIDv7, or 404 (it can name nothing)."""
    if not is_id(value, prefix):
        raise NotFound(f"{what} {printable(value)!r} not found", param=param, code=code)
    return value


def row_id(value: str) -> int:
    """A row ID from a path: ASCII digits within the store's range, or 404."""
    if not _DIGITS.fullmatch(value) or not 1 <= int(value) <= MAX_ROW_ID:
        raise NotFound(f"row {value[:40]!r} not found", param="rowId")
    return int(value)
