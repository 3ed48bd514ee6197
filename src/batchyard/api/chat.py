"""``POST /v1/chat/completions``: OpenAI's shape in and out, billed and limited.

The request is checked, counted with the model's tokenizer, held against the
caller's credit at its most expensive (every prompt token plus ``max_tokens``
for each of ``n`` samples), dispatched, and settled to the real usage. The
response is OpenAI's, with the settled ``charge`` added as a decimal string.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchyard.api.context import (
    authenticate,
    check_tier_limits,
    idempotent,
    read_json,
    service_of,
)
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.money import format_money, quote_ticks
from batchyard.core.prices import Price
from batchyard.engines.base import CompletionRequest
from batchyard.errors import ContextWindowExceeded, InvalidRequest, UnsupportedInput

__all__ = ["ChatBody", "router", "validation_error"]

router = APIRouter()


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def validation_error(exc: ValidationError) -> InvalidRequest:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    return InvalidRequest(f"{loc}: {first.get('msg')}", param=loc or None)


def _check_messages(messages: list[dict[str, Any]], reads_images: bool) -> bool:
    has_image = False
    for i, m in enumerate(messages):
        if m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidRequest(
                f"messages[{i}].role is not a chat role", param=f"messages.{i}.role"
            )
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of parts",
                param=f"messages.{i}.content",
            )
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                has_image = True
            elif kind != "text":
                raise InvalidRequest(
                    f"messages[{i}] has a content part of unknown type {kind!r}",
                    param=f"messages.{i}.content",
                )
    if has_image and not reads_images:
        raise UnsupportedInput(
            "this model reads text only; send images to kettei-chub or kettei-fat"
        )
    return has_image


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    svc = service_of(request)
    try:
        body = ChatBody.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if body.stream:
        raise InvalidRequest("streaming is not supported; send stream: false", param="stream")
    if body.tools:
        raise InvalidRequest("tools are not supported by this gateway", param="tools")
    model = svc.catalog.model(body.model)
    route = svc.catalog.route_for(model.id)
    _check_messages(body.messages, model.reads_images)
    max_tokens = (
        body.max_completion_tokens
        or body.max_tokens
        or min(svc.settings.default_max_tokens, model.max_output_tokens)
    )
    if max_tokens > model.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens can be at most {model.max_output_tokens} for {model.id}",
            param="max_tokens",
            code="max_tokens_out_of_range",
        )
    input_tokens = svc.tokenizer(model).count_messages(body.messages)
    if input_tokens + max_tokens > model.context_window:
        raise ContextWindowExceeded(
            f"{input_tokens} prompt tokens + max_tokens {max_tokens} exceed the "
            f"{model.context_window}-token context window of {model.id}",
            param="messages",
        )
    price = Price(model.input_per_mtok, model.output_per_mtok)
    max_cost = quote_ticks(price.cost(input_tokens, max_tokens * body.n))
    stop = [body.stop] if isinstance(body.stop, str) else body.stop

    async def handler() -> tuple[int, Any]:
        await check_tier_limits(request, principal, requests=1, tokens=input_tokens)
        req = CompletionRequest(
            model=route.upstream_model,
            messages=body.messages,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            n=body.n,
            stop=stop,
            seed=body.seed,
            response_format=body.response_format,
            logprobs=body.logprobs,
            top_logprobs=body.top_logprobs,
        )
        now = svc.clock.now()
        call_id = new_id("chatcmpl", now)
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
        c = result.completion
        return 200, {
            "id": call_id,
            "object": "chat.completion",
            "created": int(now.timestamp()),
            "model": model.id,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": ch.text},
                    "finish_reason": ch.finish_reason,
                    **({"logprobs": {"content": ch.logprobs}} if ch.logprobs is not None else {}),
                }
                for i, ch in enumerate(c.choices)
            ],
            "usage": {
                "prompt_tokens": c.usage.input_tokens,
                "completion_tokens": c.usage.output_tokens,
                "total_tokens": c.usage.total_tokens,
            },
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
            "created_at": isoformat(now),
        }

    return await idempotent(request, principal, raw, handler)
