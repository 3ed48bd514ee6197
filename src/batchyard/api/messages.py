"""Anthropic's door: ``/v1/messages``, ``count_tokens`` and Message Batches, onto the same core.

A Messages body is checked strictly and translated into the OpenAI-shaped
request every engine takes (``core.anthropic_bodies.translate``, which a Message
Batch's lines store too); from there it is the chat door's path, not a copy of
it: the same scope row, preparation and ``openai_door.ModelCall``, streams
written by the one loop in Anthropic's events (``_Events``). A Message Batch is
a file batch underneath (``service.message_batches`` explains the mapping).

What differs is only the wire: the key may come as ``x-api-key``;
``anthropic-version`` is read, and any date is answered in the newest shapes this
door knows (a list of accepted dates breaks on the SDK's next release); answers
are Anthropic's objects and events, and every error, whichever layer raised it,
leaves in Anthropic's envelope with its statuses (529 ``overloaded_error`` when
the model or its upstream is overloaded), batchyard's stable ``code`` beside.

``count_tokens`` counts the prompt as the model will see it, runs no model and
charges nothing; it spends from the tier's estimate budget, as
``/v1/decide/estimate`` does.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import (
    Caller,
    ServiceDep,
    allow_query,
    check_tier_limits,
    finished_query,
    once,
    path_id,
    query_id_cursor,
    query_limit,
    read_empty,
    read_json,
)
from batchyard.api.envelope import anthropic_error, anthropic_status, envelope_of
from batchyard.api.openai_door import ModelCall, prepared, read_body, sse
from batchyard.api.openapi import (
    MODEL_CALL,
    AnthropicMessage,
    Finished,
    MessageTokensCount,
    declare,
)
from batchyard.core.accounts import Principal
from batchyard.core.anthropic_bodies import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_version_ok,
    openai_prompt,
    parse_count_tokens,
    parse_messages,
    tool_id,
    translate,
    usage_object,
)
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import check_images
from batchyard.engines.protocol import Delta
from batchyard.errors import BatchyardError, InvalidRequest
from batchyard.service import Service, message_batches
from batchyard.service.files import settings_of
from batchyard.service.message_batches import MessageBatchBody
from batchyard.work.dispatcher import DispatchResult
from batchyard.work.openai_wire import anthropic_message, messages_request

__all__ = ["router"]


async def _anthropic_wire(request: Request) -> None:
    """Anthropic's request-id header on every answer, and its version read before all else."""
    env = envelope_of(request)
    env.extra_headers["request-id"] = env.request_id
    version = request.headers.get("anthropic-version")
    if version is not None and not anthropic_version_ok(version):
        raise InvalidRequest(
            f"anthropic-version {version!r} is not a date; send one such as "
            "2023-06-01 (every dated version is answered in the newest shapes)",
            param="anthropic-version",
            code="unsupported_anthropic_version",
        )


#: Every route here is Anthropic's door (its errors: ``envelope.error_response``).
router = APIRouter(dependencies=[Depends(_anthropic_wire)])
_PATH = "/v1/messages/batches"
BatchId = Annotated[str, path_id("batch_id", "bat", "message batch", param="message_batch_id")]
#: ``message_batches.cancel`` or ``retry``: a change to one batch, answered with its view.
_Change = Callable[..., Awaitable[dict[str, Any]]]


def translated(request: Request, response: Response) -> Response:
    """A saved (replayed) error, written in batchyard's envelope, rewritten in Anthropic's."""
    if response.status_code < 400 or isinstance(response, StreamingResponse):
        return response
    try:
        saved = json.loads(bytes(response.body))
    except ValueError:
        return response
    err = saved.get("error") if isinstance(saved, dict) else None
    if saved.get("type") == "error" or not isinstance(err, dict):
        return response
    body = anthropic_error(
        response.status_code,
        str(err.get("message", "")),
        str(err.get("code", "error")),
        envelope_of(request).request_id,
        err,
    )
    out = JSONResponse(body, status_code=response.status_code)
    for name in ("idempotent-replayed", "x-should-retry"):
        if name in response.headers:
            out.headers[name] = response.headers[name]
    return out


# -- streams --------------------------------------------------------------------------


def _start(call_id: str, model: str, input_tokens: int) -> bytes:
    message: dict[str, Any] = {
        "id": call_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_object(input_tokens, 0),
        "container": None,
    }
    return sse({"type": "message_start", "message": message}, "message_start")


def _end(whole: dict[str, Any]) -> list[bytes]:
    usage = whole["usage"]
    delta = {
        "type": "message_delta",
        "delta": {
            "stop_reason": whole["stop_reason"],
            "stop_sequence": whole["stop_sequence"],
            "container": None,
        },
        "usage": {
            "input_tokens": usage["input_tokens"],
            "output_tokens": usage["output_tokens"],
            "cache_creation_input_tokens": None,
            # What the cache gave is known only now: message_start counted the whole prompt.
            "cache_read_input_tokens": usage.get("cache_read_input_tokens"),
            "server_tool_use": None,
        },
    }
    return [sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]


class _Blocks:
    """Turns engine pieces into content-block events, one block open at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text" or the key of a tool call
        self._tools: dict[Any, int] = {}

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        stop = {"type": "content_block_stop", "index": self.count - 1}
        return [sse(stop, "content_block_stop")]

    def _begin(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        start = {"type": "content_block_start", "index": self.count, "content_block": block}
        out.append(sse(start, "content_block_start"))
        self.count += 1
        self.open = kind
        return out

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self._begin("text", _text_block(""))
        delta = {"type": "text_delta", "text": text}
        out.append(_delta(self.count - 1, delta))
        return out

    def tool(self, k: int, call: dict[str, Any]) -> list[bytes]:
        """A whole call (the embedded engine) or an upstream's fragment of one (with ``index``)."""
        key = call.get("index", f"whole-{k}-{self.count}")
        fn = call.get("function") or {}
        out: list[bytes] = []
        if key not in self._tools:
            block = {
                "type": "tool_use",
                "id": tool_id(call),
                "name": fn.get("name", ""),
                "input": {},
            }
            out += self._begin(f"tool-{key}", block)
            self._tools[key] = self.count - 1
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out.append(_delta(self._tools[key], delta))
        return out

    def finish(self) -> list[bytes]:
        if self.count == 0:  # an empty answer is still one (empty) text block
            return [*self._begin("text", _text_block("")), *self._close()]
        return self._close()


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "citations": None}


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    body = {"type": "content_block_delta", "index": index, "delta": delta}
    return sse(body, "content_block_delta")


@dataclass
class _Events:
    """Anthropic's stream ``Dialect``: ``message_start``, content blocks, ``message_stop``."""

    call_id: str
    model: str
    input_tokens: int
    request_id: str
    blocks: _Blocks = field(default_factory=_Blocks)

    def opening(self) -> list[bytes]:
        ping = sse({"type": "ping"}, "ping")
        return [_start(self.call_id, self.model, self.input_tokens), ping]

    def piece(self, piece: Delta) -> list[bytes]:
        out = self.blocks.text(piece.text) if piece.text else []
        for k, call in enumerate(piece.tool_calls or []):
            out += self.blocks.tool(k, call)
        return out

    def closing(self, whole: dict[str, Any]) -> list[bytes]:
        return [*self.blocks.finish(), *_end(whole)]

    def error(self, exc: BatchyardError) -> bytes:
        # The status line has gone: Anthropic's clients read an error event.
        body = anthropic_error(anthropic_status(exc), exc.message, exc.code, self.request_id, {})
        return sse(body, "error")

    def replay(self, whole: dict[str, Any]) -> bytes:
        """A saved message as the stream it was: each block whole, then the end."""
        usage = whole["usage"]
        prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
        parts = [_start(whole["id"], whole["model"], prompt)]
        blocks = _Blocks()
        for k, block in enumerate(whole["content"]):
            if block["type"] == "text":
                parts += blocks.text(block["text"])
            else:
                call = {
                    "id": block["id"],
                    "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
                }
                parts += blocks.tool(k, call)
        parts += blocks.finish()
        parts += _end(whole)
        return b"".join(parts)


# -- the routes -----------------------------------------------------------------------


@router.post("/v1/messages", summary="Messages (Anthropic's shape)")
@declare(AnthropicMessage, body=MessagesRequest, errors=(*MODEL_CALL, 529), streams=True)
async def create_message(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_messages)
    asked = translate(body)
    org_id, stream = principal.org_id, bool(body.stream)
    p = prepared(body.model, lambda: svc.preparer.messages(asked, org_id=org_id, stream=stream))
    req = messages_request(asked, model=p.engine_model)
    call = ModelCall(request, principal, p, "chat", new_id("msg", svc.clock.now()))

    def message(result: DispatchResult) -> dict[str, Any]:
        # A whole answer's header; a stream's has gone before its charge is known.
        envelope_of(request).extra_headers["x-batchyard-charge"] = format_money(result.charge)
        return anthropic_message(
            id=call.ref, model=p.model.id, completion=result.completion, stops=asked.stop
        )

    events = None
    if body.stream:
        request_id = envelope_of(request).request_id
        events = _Events(call.ref, p.model.id, p.input_tokens, request_id)
    return translated(request, await call.answer(raw, [req], message, events))


@router.post(
    "/v1/messages/count_tokens", summary="Count a Messages prompt's tokens without running it"
)
@declare(MessageTokensCount, body=CountTokensRequest, errors=(429,))
async def count_tokens(request: Request) -> Response:
    principal, _, svc, body = await read_body(request, parse_count_tokens)
    prompt, tools, choice = openai_prompt(body)

    def count() -> int:
        model, _ = svc.preparer.resolve(body.model, org_id=principal.org_id)
        check_images(prompt, model)
        return svc.preparer.count_chat(model, prompt, tools, choice)

    counted = prepared(body.model, count)
    await check_tier_limits(request, principal, tokens=counted, kind="estimate")
    return JSONResponse({"input_tokens": counted})


# -- Message Batches ------------------------------------------------------------------


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


@router.post(_PATH, summary="Create a Message Batch (Anthropic's shape; a file batch underneath)")
@declare(body=MessageBatchBody, errors=(402,))
async def create_message_batch(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=settings_of(svc).max_bytes)

    async def handler() -> dict[str, Any]:
        view = await message_batches.create(svc, principal, raw)
        svc.file_batches.notify()
        return view

    return translated(request, await once(request, principal, raw, handler))


@router.get(_PATH, summary="Message Batches, newest first (before_id / after_id)")
async def list_message_batches(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    allow_query(request, "after_id", "before_id", "limit")
    limit = query_limit(request, default=20, most=1000)
    after = query_id_cursor(request, "bat", name="after_id")
    before = query_id_cursor(request, "bat", name="before_id")
    if after and before:
        raise InvalidRequest("send after_id or before_id, not both", param="before_id")
    page = await message_batches.list_page(
        svc, principal, limit=limit, after=after, before=before, base_url=_base(request)
    )
    return JSONResponse(page)


@router.get(_PATH + "/{batch_id}")
async def get_message_batch(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    view = await message_batches.get(svc, principal, batch_id, base_url=_base(request))
    return JSONResponse(view)


@router.post(_PATH + "/{batch_id}/cancel")
async def cancel_message_batch(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    return await _changed(request, principal, batch_id, svc, message_batches.cancel)


@router.post(
    _PATH + "/{batch_id}/retry",
    summary="A batchyard extension: a new batch of the errored, canceled, expired requests",
)
@declare(errors=(402,))
async def retry_message_batch(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    return await _changed(request, principal, batch_id, svc, message_batches.retry)


async def _changed(
    request: Request, principal: Principal, batch_id: str, svc: Service, change: _Change
) -> Response:
    """Cancel or retry: once per idempotency key, then the worker is woken for what it holds."""
    body = await read_empty(request)

    async def handler() -> dict[str, Any]:
        view = await change(svc, principal, batch_id, base_url=_base(request))
        svc.file_batches.notify()
        return view

    return translated(request, await once(request, principal, body, handler))


@router.get(
    _PATH + "/{batch_id}/results",
    summary="Results, one {custom_id, result} line per request, once ended",
)
@declare(errors=(409,), media="application/x-jsonl")
async def message_batch_results(principal: Caller, batch_id: BatchId, svc: ServiceDep) -> Response:
    lines = await message_batches.results(svc, principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-jsonl")


@router.get(
    _PATH + "/{batch_id}/finished",
    summary="A batchyard extension: the results so far, from a cursor, while it runs",
)
@declare(Finished)
async def message_batch_finished(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    after, limit = finished_query(request)
    page = await message_batches.finished(svc, principal, batch_id, after=after, limit=limit)
    return JSONResponse(page)
