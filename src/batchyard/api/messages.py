"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's door onto the same core.

A Messages body is checked strictly and translated into the OpenAI-shaped
request every engine already takes (``core.anthropic_bodies``); from there it
is the chat door's path, not a copy of it: the same authentication and scope
row (``service.access``), the same quote (``api.chat.quote_chat``: counted
with the model's tokenizer, ``max_tokens`` and the context window checked),
the same tier limits and concurrency slot, the same Idempotency-Key rules
(``api.context.idempotent``, and ``api.keyed_streams`` for streams), and the
same reserve → call → settle in the dispatcher, which bills a stream cut
short for the tokens it produced. Tools are answered under a grammar by the
embedded engine, as for OpenAI's tools.

What differs is only the wire: the key may come as ``x-api-key``;
``anthropic-version`` is read (an unknown version is refused); answers are
Anthropic's ``message`` objects and stream events (``message_start``,
``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``); and every error,
whichever layer raised it, leaves in Anthropic's envelope
``{"type": "error", "error": {"type", "message"}}`` with Anthropic's statuses
(``overloaded_error`` as 529 when the model or its upstream is overloaded),
keeping batchyard's stable ``code`` beside them.

``count_tokens`` counts the prompt as the model will see it (the tools'
instructions included) with the model's real tokenizer, runs no model and
charges nothing; it spends from the tier's estimate budget, as
``/v1/decide/estimate`` does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.chat import check_images, quote_chat
from batchyard.api.context import (
    authenticate,
    check_tier_limits,
    idempotent,
    json_response,
    read_json,
    service_of,
)
from batchyard.api.envelope import envelope_of
from batchyard.api.errors import error_headers
from batchyard.api.keyed_streams import open_stream
from batchyard.api.openai_door import resolve
from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.core.anthropic_bodies import (
    ANTHROPIC_VERSIONS,
    ERROR_TYPES,
    message_object,
    parse_count_tokens,
    parse_messages,
    to_openai_messages,
    to_openai_tool_choice,
    to_openai_tools,
    tool_id,
    usage_object,
)
from batchyard.core.catalog import ModelSpec
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.engines import tool_calls
from batchyard.engines.base import Completion, CompletionRequest, Delta
from batchyard.errors import (
    BatchyardError,
    InternalError,
    InvalidRequest,
    ModelWarming,
    UpstreamRateLimited,
)
from batchyard.service import Service
from batchyard.work.dispatcher import DispatchResult

__all__ = ["anthropic_door", "anthropic_error", "router"]

router = APIRouter()

# -- errors, in Anthropic's envelope -------------------------------------------------


def _status(exc: BatchyardError) -> int:
    """Anthropic's status for an error: 529 where the model or its upstream is overloaded."""
    if isinstance(exc, UpstreamRateLimited | ModelWarming):
        return 529
    return exc.status


def anthropic_error(
    status: int, message: str, code: str, request_id: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """Anthropic's error body; batchyard's stable ``code`` (and ``param``) ride beside its type."""
    error: dict[str, Any] = {
        "type": ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"),
        "message": message,
        "code": code,
    }
    error.update({k: v for k, v in extra.items() if k in ("param", "retry_after")})
    body: dict[str, Any] = {"type": "error", "error": error}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def _error_response(request: Request, exc: BatchyardError) -> JSONResponse:
    status = _status(exc)
    extra: dict[str, Any] = {"param": exc.param} if exc.param is not None else {}
    if exc.retry_after is not None:
        extra["retry_after"] = exc.retry_after
    body = anthropic_error(status, exc.message, exc.code, envelope_of(request).request_id, extra)
    return JSONResponse(body, status_code=status, headers=error_headers(exc))


def _translated(request: Request, response: Response) -> Response:
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


def anthropic_door(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Anthropic's wire around a handler: its request-id header, its version, its errors."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        env = envelope_of(request)
        env.extra_headers["request-id"] = env.request_id
        try:
            version = request.headers.get("anthropic-version")
            if version is not None and version not in ANTHROPIC_VERSIONS:
                raise InvalidRequest(
                    f"anthropic-version {version!r} is not one this server speaks; "
                    f"send one of {', '.join(sorted(ANTHROPIC_VERSIONS))}",
                    param="anthropic-version",
                    code="unsupported_anthropic_version",
                )
            return _translated(request, await handler(request))
        except BatchyardError as exc:
            return _error_response(request, exc)

    return wrapped


# -- the request ----------------------------------------------------------------------


def _prompt_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """The messages as the embedded engine renders them, for counting: tools' prompt included."""
    if not tools or choice == "none":
        return messages
    guide = {"role": "system", "content": tool_calls.tools_prompt(tools, choice)}
    return [guide, *tool_calls.plain_messages(messages)]


# -- the answer -----------------------------------------------------------------------


def _matched_stop(completion: Completion, stops: list[str] | None) -> str | None:
    """The stop sequence that ended the answer, where the engine says which (the embedded
    engine and vLLM do)."""
    if not stops:
        return None
    if completion.choices and completion.choices[0].stop_sequence in stops:
        return completion.choices[0].stop_sequence
    choices = completion.raw.get("choices") if isinstance(completion.raw, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else {}
    said = first.get("stop_reason") if isinstance(first, dict) else None
    return said if isinstance(said, str) and said in stops else None


def _message(
    call_id: str, model: str, result: DispatchResult, stops: list[str] | None
) -> dict[str, Any]:
    """The whole ``message`` object of an answer."""
    choice = result.completion.choices[0]
    usage = result.completion.usage
    return message_object(
        message_id=call_id,
        model=model,
        text=choice.text,
        tool_calls=choice.tool_calls,
        finish_reason=choice.finish_reason,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        matched_stop=_matched_stop(result.completion, stops),
    )


# -- streams --------------------------------------------------------------------------


def _event(name: str, data: dict[str, Any]) -> bytes:
    return (
        f"event: {name}\ndata: ".encode()
        + json.dumps(data, separators=(",", ":")).encode()
        + (b"\n\n")
    )


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
    return _event("message_start", {"type": "message_start", "message": message})


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
            "cache_read_input_tokens": None,
            "server_tool_use": None,
        },
    }
    return [_event("message_delta", delta), _event("message_stop", {"type": "message_stop"})]


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
        return [
            _event("content_block_stop", {"type": "content_block_stop", "index": self.count - 1})
        ]

    def _begin(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": self.count, "content_block": block},
            )
        )
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
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def _replay(saved: idem_rules.SavedResponse) -> Response:
    """A saved answer as the stream it was: each block whole, then the end."""
    headers = {"Idempotent-Replayed": "true"}
    if saved.status_code != 200:
        return Response(
            saved.body,
            status_code=saved.status_code,
            media_type="application/json",
            headers=headers,
        )
    whole = json.loads(saved.body)
    parts = [_start(whole["id"], whole["model"], whole["usage"]["input_tokens"])]
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
    return Response(b"".join(parts), media_type="text/event-stream", headers=headers)


async def _stream(
    request: Request,
    svc: Service,
    principal: Principal,
    raw: dict[str, Any],
    *,
    call_id: str,
    model: ModelSpec,
    input_tokens: int,
    stops: list[str] | None,
    start: Callable[[], AsyncIterator[Delta | DispatchResult]],
    before: Callable[[], Any],
) -> Response:
    opened = await open_stream(request, svc, principal, raw, start=start, before=before)
    if isinstance(opened, idem_rules.SavedResponse):
        return _replay(opened)
    request_id = envelope_of(request).request_id

    async def events() -> AsyncIterator[bytes]:
        finished = False
        blocks = _Blocks()
        try:
            yield _start(call_id, model.id, input_tokens)
            yield _event("ping", {"type": "ping"})
            piece: Delta | DispatchResult = opened.first
            while True:
                if isinstance(piece, DispatchResult):
                    whole = _message(call_id, model.id, piece, stops)
                    for part in [*blocks.finish(), *_end(whole)]:
                        yield part
                    finished = True
                    await opened.save(whole)
                    return
                if piece.text:
                    for part in blocks.text(piece.text):
                        yield part
                for k, call in enumerate(piece.tool_calls or []):
                    for part in blocks.tool(k, call):
                        yield part
                piece = await anext(opened.pieces)
        except BatchyardError as exc:
            # The status line has gone: Anthropic's clients read an error event.
            body = anthropic_error(_status(exc), exc.message, exc.code, request_id, {})
            yield _event("error", body)
        except StopAsyncIteration:
            lost = InternalError("the stream ended without a result")
            yield _event("error", anthropic_error(500, lost.message, lost.code, request_id, {}))
        finally:
            if not finished:
                await opened.abandon()

    return StreamingResponse(events(), media_type="text/event-stream")


# -- the routes -----------------------------------------------------------------------


@router.post("/v1/messages")
@anthropic_door
async def create_message(request: Request) -> Response:
    principal = await authenticate(request, x_api_key=True)
    raw = await read_json(request)
    svc = service_of(request)
    body = parse_messages(raw)
    messages = to_openai_messages(body)
    tools = to_openai_tools(body)
    choice = to_openai_tool_choice(body)
    use_tools = bool(tools) and choice != "none"
    needs = ["chat"]
    if body.stream:
        needs.append("stream")
    if use_tools:
        needs.append("tools")
    model, route = resolve(svc, body.model, *needs, org_id=principal.org_id)
    check_images(messages, model.reads_images)
    quote = quote_chat(svc, model, _prompt_messages(messages, tools, choice), body.max_tokens)
    stops = body.stop_sequences or None
    req = CompletionRequest(
        model=svc.catalog.engine_name(model.id, route),
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=stops,
        tools=tools if use_tools else None,
        tool_choice=choice if use_tools else None,
    )
    call_id = new_id("msg", svc.clock.now())

    async def limits() -> None:
        await check_tier_limits(request, principal, requests=1, tokens=quote.input_tokens)

    if body.stream:
        return await _stream(
            request,
            svc,
            principal,
            raw,
            call_id=call_id,
            model=model,
            input_tokens=quote.input_tokens,
            stops=stops,
            start=lambda: svc.dispatcher.stream(
                org_id=principal.org_id,
                model=model,
                route=route,
                request=req,
                input_tokens=quote.input_tokens,
                max_cost=quote.max_cost,
                price=quote.price,
                purpose="chat",
                count_tokens=quote.tokenizer.count,
                ref=call_id,
            ),
            before=limits,
        )

    async def handler() -> tuple[int, Any]:
        await limits()
        result = await svc.dispatcher.execute(
            org_id=principal.org_id,
            model=model,
            route=route,
            request=req,
            input_tokens=quote.input_tokens,
            max_cost=quote.max_cost,
            price=quote.price,
            purpose="chat",
            ref=call_id,
        )
        envelope_of(request).extra_headers["x-batchyard-charge"] = format_money(result.charge)
        return 200, _message(call_id, model.id, result, stops)

    return await idempotent(request, principal, raw, handler)


@router.post("/v1/messages/count_tokens")
@anthropic_door
async def count_tokens(request: Request) -> Response:
    principal = await authenticate(request, x_api_key=True)
    raw = await read_json(request)
    svc = service_of(request)
    body = parse_count_tokens(raw)
    messages = to_openai_messages(body)
    tools = to_openai_tools(body)
    choice = to_openai_tool_choice(body)
    model, _ = resolve(svc, body.model)
    check_images(messages, model.reads_images)
    counted = svc.tokenizer(model).count_messages(_prompt_messages(messages, tools, choice))
    await check_tier_limits(request, principal, requests=0, tokens=counted, kind="estimate")
    return json_response({"input_tokens": counted})
