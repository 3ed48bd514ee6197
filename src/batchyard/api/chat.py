"""``POST /v1/chat/completions``: OpenAI's shape in and out, billed and limited.

The request is checked strictly (``openai_requests.parse_chat``), counted with
the model's tokenizer, held against the caller's credit at its most expensive
(every prompt token plus ``max_tokens`` for each of ``n`` samples),
dispatched, and settled to the real usage. The response is OpenAI's, with the
settled ``charge`` added as a decimal string.

``stream: true`` answers server-sent events in OpenAI's chunk shape (see
``openai_door``); tools pass through to routes whose catalog entry supports
them, and the embedded model answers them under a grammar.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.context import (
    authenticate,
    check_tier_limits,
    idempotent,
    read_json,
    service_of,
)
from batchyard.api.openai_door import StreamShape, resolve, sse_response
from batchyard.core.catalog import ModelSpec
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import parse_chat
from batchyard.core.prices import Price
from batchyard.core.quotes import check_context, direct_price, quote
from batchyard.core.tokens import Tokenizer
from batchyard.engines.base import Choice, CompletionRequest, Delta
from batchyard.errors import InvalidRequest, UnsupportedInput
from batchyard.service import Service
from batchyard.work.dispatcher import DispatchResult

__all__ = ["Quote", "chat_choice", "check_images", "quote_chat", "router"]

router = APIRouter()


def check_images(messages: list[dict[str, Any]], reads_images: bool) -> None:
    """Refuse image parts for a model that reads text only (a coded 400, nothing charged)."""
    has_image = any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )
    if has_image and not reads_images:
        raise UnsupportedInput(
            "this model reads text only; send images to kettei-chub or kettei-fat"
        )


@dataclass(frozen=True, slots=True)
class Quote:
    """What a chat call may cost at most: its prompt counted, its price, the hold."""

    tokenizer: Tokenizer
    input_tokens: int
    price: Price
    max_cost: int


def quote_chat(
    svc: Service, model: ModelSpec, messages: list[dict[str, Any]], max_tokens: int, n: int = 1
) -> Quote:
    """Count ``messages`` with the model's tokenizer and price the most the call can cost.

    ``max_tokens`` over the model's output limit, or a prompt that leaves no
    room for it in the context window, is a coded 400 before anything is held.
    """
    if max_tokens > model.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens can be at most {model.max_output_tokens} for {model.id}",
            param="max_tokens",
            code="max_tokens_out_of_range",
        )
    tok = svc.tokenizer(model)
    input_tokens = tok.count_messages(messages)
    check_context(model, input_tokens, max_tokens, param="messages")
    price = direct_price(model)
    return Quote(tok, input_tokens, price, quote(model, input_tokens, max_tokens, n))


def _logprobs(ch: Choice, wanted: bool) -> dict[str, Any] | None:
    if not wanted or ch.logprobs is None:
        return None
    content = [{**lp, "top_logprobs": lp.get("top_logprobs") or []} for lp in ch.logprobs]
    return {"content": content, "refusal": None}


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": c["function"].get("arguments") or "",
            },
        }
        for c in calls
    ]


def chat_choice(i: int, ch: Choice, logprobs: bool) -> dict[str, Any]:
    """One choice of a ``chat.completion``, OpenAI's shape."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": ch.text if (ch.text or not ch.tool_calls) else None,
        "refusal": None,
    }
    if ch.tool_calls:
        message["tool_calls"] = _tool_calls(ch.tool_calls)
    return {
        "index": i,
        "message": message,
        "finish_reason": ch.finish_reason,
        "logprobs": _logprobs(ch, logprobs),
    }


def _usage(result: DispatchResult) -> dict[str, Any]:
    u = result.completion.usage
    usage: dict[str, Any] = {
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
    }
    if u.cached_input_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_input_tokens}
    return usage


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    svc = service_of(request)
    body = parse_chat(raw)
    needs = ["chat"]
    if body.stream:
        needs.append("stream")
    if body.tools and body.tool_choice != "none":
        needs.append("tools")
    model, route = resolve(svc, body.model, *needs, org_id=principal.org_id)
    check_images(body.messages, model.reads_images)
    max_tokens = (
        body.max_completion_tokens
        or body.max_tokens
        or min(svc.settings.default_max_tokens, model.max_output_tokens)
    )
    quote = quote_chat(svc, model, body.messages, max_tokens, body.n)
    tok, input_tokens, price, max_cost = (
        quote.tokenizer,
        quote.input_tokens,
        quote.price,
        quote.max_cost,
    )
    req = CompletionRequest(
        model=svc.catalog.engine_name(model.id, route),
        messages=body.messages,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        n=body.n,
        stop=body.stop_list(),
        seed=body.seed,
        response_format=body.response_format,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs,
        tools=body.tools if body.tool_choice != "none" else None,
        tool_choice=body.tool_choice if body.tool_choice != "none" else None,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
    )
    now = svc.clock.now()
    call_id = new_id("chatcmpl", now)
    created = int(now.timestamp())

    def whole(result: DispatchResult) -> dict[str, Any]:
        return {
            "id": call_id,
            "object": "chat.completion",
            "created": created,
            "model": model.id,
            "system_fingerprint": None,
            "choices": [
                chat_choice(i, ch, bool(body.logprobs))
                for i, ch in enumerate(result.completion.choices)
            ],
            "usage": _usage(result),
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
            "created_at": isoformat(now),
        }

    async def limits() -> None:
        await check_tier_limits(request, principal, requests=1, tokens=input_tokens)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await sse_response(
            request,
            svc,
            principal,
            raw,
            call_id=call_id,
            created=created,
            model=model.id,
            n=body.n,
            include_usage=include_usage,
            shape=StreamShape(
                object="chat.completion.chunk",
                first=_first_chunk,
                piece=lambda d: _piece(d, bool(body.logprobs)),
                replay=_replay_choices,
                whole=whole,
            ),
            start=lambda: svc.dispatcher.stream(
                org_id=principal.org_id,
                model=model,
                route=route,
                request=req,
                input_tokens=input_tokens,
                max_cost=max_cost,
                price=price,
                purpose="chat",
                count_tokens=tok.count,
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
            input_tokens=input_tokens,
            max_cost=max_cost,
            price=price,
            purpose="chat",
            ref=call_id,
        )
        return 200, whole(result)

    return await idempotent(request, principal, raw, handler)


def _first_chunk(i: int) -> dict[str, Any]:
    return {
        "index": i,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def _piece(d: Delta, logprobs: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if d.text:
        delta["content"] = d.text
    if d.tool_calls:
        if all("index" in call for call in d.tool_calls):
            delta["tool_calls"] = d.tool_calls  # an upstream's own fragments, as they came
        else:
            calls = _tool_calls(d.tool_calls)
            delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(calls)]
    lp = None
    if logprobs and d.logprobs is not None:
        lp = {
            "content": [{**x, "top_logprobs": x.get("top_logprobs") or []} for x in d.logprobs],
            "refusal": None,
        }
    return {"index": d.index, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}


def _replay_choices(whole: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for ch in whole.get("choices", []):
        message = ch.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {**call, "index": k} for k, call in enumerate(message["tool_calls"])
            ]
        out.append(
            {
                "index": ch.get("index", 0),
                "delta": delta,
                "logprobs": ch.get("logprobs"),
                "finish_reason": ch.get("finish_reason"),
            }
        )
    return out
