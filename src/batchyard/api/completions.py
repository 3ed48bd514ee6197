"""``POST /v1/completions``: OpenAI's (legacy) text completions, billed and limited like chat.

The prompt goes to the model as it is, with no chat template; ``n`` samples
of it are answered and billed like chat's. A list of prompts is answered as
OpenAI does, one choice per prompt × ``n`` in order (prompt ``i``'s samples
are choices ``i*n`` to ``i*n+n-1``), and is one call to its caller: one tier
check, one hold for the whole list, one charge. A prompt of token ids is read
as ``cl100k_base`` ids (``engines.token_ids``). The answer is the
``text_completion`` of ``work.openai_wire``, which a file batch's lines share.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.openai_door import Chunks, ModelCall, prepared, read_body
from batchyard.api.openapi import MODEL_CALL, TextCompletion, declare
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import CompletionTextRequest, parse_completion
from batchyard.engines.protocol import Delta
from batchyard.engines.token_ids import as_texts
from batchyard.errors import CapabilityUnsupported
from batchyard.work.dispatcher import DispatchResult
from batchyard.work.openai_wire import Reply, text_piece, text_replay, text_requests

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/completions", summary="Text completions (OpenAI's shape)")
@declare(TextCompletion, body=CompletionTextRequest, errors=MODEL_CALL, streams=True)
async def completions(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_completion)
    prompts = as_texts(body.prompts(), "prompt")
    if body.stream and len(prompts) > 1:
        raise CapabilityUnsupported(
            "a stream answers one prompt; send the list without stream", param="stream"
        )
    org_id, stream = principal.org_id, bool(body.stream)
    p = prepared(
        body.model, lambda: svc.preparer.completion(body, prompts, org_id=org_id, stream=stream)
    )
    reqs = text_requests(body, prompts, model=p.engine_model, max_tokens=p.max_tokens)
    now = svc.clock.now()
    call = ModelCall(request, principal, p, "completions", new_id("cmpl", now))
    reply = Reply(call.ref, int(now.timestamp()), p.model.id)

    def render(result: DispatchResult) -> dict[str, Any]:
        return {
            **reply.text(result.completion, body, prompts),
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
        }

    chunks = None
    if body.stream:
        echo = prompts[0] if body.echo else ""
        chunks = Chunks(
            reply=reply,
            object="text_completion",
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            first=lambda i: text_piece(Delta(i, echo)),
            choice=text_piece,
            render=render,
            replayed=text_replay,
        )
    return await call.answer(raw, reqs, render, chunks)
