"""What the OpenAI-compatible endpoints share: the model, its capabilities, and streams.

``resolve`` turns the body's model into the catalog's model and route, with
OpenAI's 404 ``model_not_found`` for a name nobody serves and a coded 400
(``capability_unsupported``) when the route cannot do what is asked.

``sse_response`` sends a dispatcher stream as server-sent events, under the
same Idempotency-Key rules as every POST (``keyed_streams``, shared with
Anthropic's door): the key is claimed before the first byte, the whole answer
is saved when the stream ends, and a replay of the same request gets the saved
answer back as a stream (one chunk holding the whole text, then the usage
chunk if asked for, then ``[DONE]``). A stream that stops early (the client
hung up) saves nothing: the same key runs again, and the partial answer has
been billed exactly for the tokens produced.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from batchyard.api.keyed_streams import open_stream
from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.core.catalog import ModelSpec, RouteSpec
from batchyard.engines.base import Delta
from batchyard.errors import (
    BatchyardError,
    CapabilityUnsupported,
    InternalError,
    ModelNotFound,
    UnknownModel,
)
from batchyard.service import Service
from batchyard.work.dispatcher import DispatchResult

__all__ = ["Capability", "StreamShape", "resolve", "sse_response"]

Capability = str  # "chat", "completions", "embeddings", "tools", "stream"


def resolve(svc: Service, model_id: str, *needs: Capability) -> tuple[ModelSpec, RouteSpec]:
    """The model and its primary route, checked against what the request needs."""
    try:
        model = svc.catalog.model(model_id)
    except UnknownModel:
        raise ModelNotFound(
            f"the model {model_id!r} does not exist; GET /v1/models lists the catalog",
            param="model",
        ) from None
    route = svc.catalog.route_for(model.id)
    for need in needs:
        ok = {
            "tools": route.tools,
            "stream": route.supports_streaming,
            "completions": route.serves_completions,
            "embeddings": route.embeddings,
        }.get(need, True)
        if not ok:
            raise CapabilityUnsupported(
                f"{model.id} (route {route.id}) does not support {need}; "
                "GET /v1/models lists each model's capabilities",
                param={"stream": "stream", "tools": "tools"}.get(need, "model"),
            )
    return model, route


@dataclass(frozen=True)
class StreamShape:
    """How one endpoint writes its chunks: chat's ``delta`` or completions' ``text``."""

    object: str
    first: Callable[[int], dict[str, Any]]
    piece: Callable[[Delta], dict[str, Any]]
    #: The chunks that replay a saved answer, one per choice.
    replay: Callable[[dict[str, Any]], list[dict[str, Any]]]
    #: The whole answer (as saved under a key) from the stream's result.
    whole: Callable[[DispatchResult], dict[str, Any]]


def _event(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def sse_response(
    request: Request,
    svc: Service,
    principal: Principal,
    raw: dict[str, Any],
    *,
    call_id: str,
    created: int,
    model: str,
    n: int,
    include_usage: bool,
    shape: StreamShape,
    start: Callable[[], AsyncIterator[Delta | DispatchResult]],
    before: Callable[[], Any],
) -> Response:
    """Stream ``start()``'s pieces as OpenAI chunks; see the module docstring.

    ``before`` runs after the key is claimed and before the stream starts (the
    tier's limits), so a refused request leaves the key free.
    """
    opened = await open_stream(request, svc, principal, raw, start=start, before=before)
    if isinstance(opened, idem_rules.SavedResponse):
        return _replay(opened, shape, include_usage)

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": call_id,
            "object": shape.object,
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return body

    async def events() -> AsyncIterator[bytes]:
        finished = False
        try:
            yield _event(chunk([shape.first(i) for i in range(n)]))
            piece: Delta | DispatchResult = opened.first
            while True:
                if isinstance(piece, DispatchResult):
                    whole = shape.whole(piece)
                    if include_usage:
                        yield _event(chunk([], whole["usage"]))
                    yield _DONE
                    finished = True
                    await opened.save(whole)
                    return
                if piece.text or piece.tool_calls or piece.finish_reason:
                    yield _event(chunk([shape.piece(piece)]))
                piece = await anext(opened.pieces)
        except BatchyardError as exc:
            # The status line has gone; OpenAI's clients read an error event.
            yield _event(exc.to_body())
        except StopAsyncIteration:
            yield _event(InternalError("the stream ended without a result").to_body())
        finally:
            if not finished:
                await opened.abandon()

    return StreamingResponse(events(), media_type="text/event-stream")


def _replay(saved: idem_rules.SavedResponse, shape: StreamShape, include_usage: bool) -> Response:
    """The answer saved under a key, as the stream it was (or its error, as JSON)."""
    if saved.status_code != 200:
        return Response(
            saved.body,
            status_code=saved.status_code,
            media_type="application/json",
            headers={"Idempotent-Replayed": "true"},
        )
    whole = json.loads(saved.body)
    base = {k: whole.get(k) for k in ("id", "created", "model")}
    base |= {"object": shape.object, "system_fingerprint": None}
    parts = [
        _event({**base, "choices": c, **({"usage": None} if include_usage else {})})
        for c in ([ch] for ch in shape.replay(whole))
    ]
    if include_usage:
        parts.append(_event({**base, "choices": [], "usage": whole.get("usage")}))
    parts.append(_DONE)
    return Response(
        b"".join(parts),
        media_type="text/event-stream",
        headers={"Idempotent-Replayed": "true"},
    )
