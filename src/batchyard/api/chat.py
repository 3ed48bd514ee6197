"""``POST /v1/chat/completions``: OpenAI's shape in and out, billed and limited.

The request is checked strictly (``core.openai_bodies.parse_chat``), prepared
(``service.preparation``: every token the engine reads counted, the tools'
instructions included, and the most it can cost quoted), held against the
caller's credit at that quote, dispatched, and settled to the real usage
(``openai_door.ModelCall``). The
response is OpenAI's ``chat.completion`` (``work.openai_wire``, the rendering a
file batch's lines and a deferred batch's results share), with the settled
``charge`` added as a decimal string.

``stream: true`` answers server-sent events in OpenAI's chunk shape (see
``openai_door``); tools pass through to routes whose catalog entry supports
them, and the embedded model answers them under a grammar.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.openai_door import Chunks, ModelCall, prepared, read_body
from batchyard.api.openapi import MODEL_CALL, ChatCompletion, declare
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import ChatRequest, parse_chat
from batchyard.work.dispatcher import DispatchResult
from batchyard.work.openai_wire import Reply, chat_first, chat_piece, chat_replay, chat_request

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/chat/completions", summary="Chat completions (OpenAI's shape)")
@declare(ChatCompletion, body=ChatRequest, errors=MODEL_CALL, streams=True)
async def chat_completions(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_chat)
    org_id, stream = principal.org_id, bool(body.stream)
    p = prepared(body.model, lambda: svc.preparer.chat(body, org_id=org_id, stream=stream))
    req = chat_request(body, model=p.engine_model, max_tokens=p.max_tokens)
    now = svc.clock.now()
    call = ModelCall(request, principal, p, "chat", new_id("chatcmpl", now))
    reply = Reply(call.ref, int(now.timestamp()), p.model.id)
    logprobs = bool(body.logprobs)

    def render(result: DispatchResult) -> dict[str, Any]:
        return {
            **reply.chat(result.completion, logprobs=logprobs),
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
            "created_at": isoformat(now),
        }

    chunks = None
    if body.stream:
        chunks = Chunks(
            reply=reply,
            object="chat.completion.chunk",
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            first=chat_first,
            choice=lambda d: chat_piece(d, logprobs),
            render=render,
            replayed=chat_replay,
        )
    return await call.answer(raw, [req], render, chunks)
