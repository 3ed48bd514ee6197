"""``/v1/files``: OpenAI's Files, for batch inputs and the outputs batchyard writes.

An upload is ``multipart/form-data`` as the ``openai`` SDK's ``files.create``
sends it; its file part streams to disk and is then checked and stored line by
line on a thread (``service.files.ingest``): a bad file answers a coded error
naming its line and leaves nothing behind.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import (
    Caller,
    ServiceDep,
    allow_query,
    listing,
    path_id,
    query_id_cursor,
    query_limit,
    read_upload,
)
from batchyard.api.openapi import ListOf, declare
from batchyard.core.accounts import Principal
from batchyard.errors import InvalidRequest
from batchyard.service import files

__all__ = ["router"]

router = APIRouter()
FileId = Annotated[str, path_id("file_id", "file", "file", code="file_not_found")]

#: OpenAI's other purposes: named so the refusal can say what is wrong.
OTHER_PURPOSES = (
    "assistants",
    "assistants_output",
    "batch_output",
    "fine-tune",
    "fine-tune-results",
    "vision",
    "user_data",
    "evals",
)
_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")


def _purpose(given: str | None) -> str:
    if given is None:
        raise InvalidRequest("purpose is required: batch", param="purpose")
    if given in files.PURPOSES:
        return given
    why = (
        "batch_output files are written by batchyard when a batch ends"
        if given == "batch_output"
        else f"purpose {given!r} is not served here"
        if given in OTHER_PURPOSES
        else f"purpose {given!r} is not a file purpose"
    )
    raise InvalidRequest(
        f"{why}; upload with purpose batch", param="purpose", code="invalid_purpose"
    )


def _expires_after(fields: dict[str, str]) -> int | None:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or seconds is None or not seconds.isdigit():
        raise InvalidRequest(
            "expires_after is anchor created_at and seconds from 3600 to 2592000",
            param="expires_after",
        )
    value = int(seconds)
    if not 3600 <= value <= 2_592_000:
        raise InvalidRequest(
            "expires_after.seconds is from 3600 (1 hour) to 2592000 (30 days)",
            param="expires_after.seconds",
        )
    return value


@router.post("/v1/files", summary="Upload a batch input file (multipart/form-data: purpose, file)")
@declare(
    multipart={
        "type": "object",
        "required": ["purpose", "file"],
        "additionalProperties": False,
        # The expiry is both its parts or neither.
        "dependentRequired": {
            "expires_after[anchor]": ["expires_after[seconds]"],
            "expires_after[seconds]": ["expires_after[anchor]"],
        },
        "properties": {
            "purpose": {"type": "string", "enum": ["batch"]},
            # Not empty: a file with no request in it is refused (``400 empty_file``).
            "file": {"type": "string", "format": "binary", "minLength": 1},
            "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
            "expires_after[seconds]": {"type": "integer", "minimum": 3600, "maximum": 2_592_000},
        },
    }
)
async def create_file(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    svc.batch_key.require()  # 503 before the body is read when batches are off
    upload = await read_upload(request, _FIELDS, files.settings_of(svc).max_bytes)
    try:
        purpose = _purpose(upload.fields.get("purpose"))
        expires = _expires_after(upload.fields)
        view = await files.ingest_upload(
            svc, principal, upload, purpose=purpose, expires_after_s=expires
        )
    finally:
        upload.close()
    return JSONResponse(view)


@router.get("/v1/files", summary="Files")
@declare(ListOf)
async def list_files(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    q = allow_query(request, "after", "limit", "order", "purpose")
    limit = query_limit(request, default=10_000, most=10_000)
    after = query_id_cursor(request, "file", name="after")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order is asc or desc", param="order")
    purpose = q.get("purpose")
    if purpose is not None and purpose not in (*files.PURPOSES, "batch_output"):
        raise InvalidRequest(
            f"purpose {purpose!r} is not a file purpose here",
            param="purpose",
            code="invalid_purpose",
        )
    data, more = await files.list_views(
        svc, principal, after=after, limit=limit, purpose=purpose, newest_first=order == "desc"
    )
    return JSONResponse(listing(data, more))


async def _file(request: Request, principal: Caller, file_id: FileId) -> tuple[Principal, str]:
    allow_query(request)
    return principal, file_id


#: The caller and the file its path names (a show, a download or a delete takes no query).
File = Annotated[tuple[Principal, str], Depends(_file)]


@router.get("/v1/files/{file_id}")
async def get_file(file: File, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await files.get(svc, *file))


@router.get("/v1/files/{file_id}/content", summary="A file's lines")
@declare(media="application/jsonl")
async def file_content(file: File, svc: ServiceDep) -> Response:
    return StreamingResponse(await files.content(svc, *file), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file: File, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await files.delete(svc, *file))
