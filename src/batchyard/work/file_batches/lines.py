"""One line of a file batch: its route and price, its call, and its line of the result files.

Every line ends as one line of the output file (answered) or of the error
file (anything else), in OpenAI's shape, rendered once when the line ends and
kept sealed, so the files are exact and cheap to serve::

    {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}

A call that got an answer (also an error answer: a failed call) has
``response`` with the status and body the endpoint gave and ``error`` null; a
line that was never answered (``batch_expired``, ``batch_cancelled``,
``uncertain``) has ``response`` null and ``error`` ``{code, message}``. vLLM's
``run_batch`` writes the same shape.

A line is answered as its endpoint would answer it on the wire: a chat
completion, a text completion or embeddings, with the same body shape; its
charge is its share of the batch's one hold, summed when the batch settles.
The runner (``work.runner``) makes the call (``call``) and hands its answer
or its failure to ``result``, which renders the line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from batchyard.core.anthropic_bodies import message_object
from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec, engine_name
from batchyard.core.ids import new_id
from batchyard.core.market import offer_cost, qualifies
from batchyard.core.money import charge_ticks, format_money
from batchyard.core.openai_bodies import embedding_data
from batchyard.core.prices import Price
from batchyard.core.quotes import direct_price, quote
from batchyard.core.sealing import Sealer, SealError
from batchyard.engines.base import CompletionRequest, Usage
from batchyard.errors import InternalError
from batchyard.store.file_batches import Claimed, Ended, out_aad
from batchyard.store.files import line_aad
from batchyard.work.batches.prices import MarketPrices
from batchyard.work.dispatcher import Dispatcher, OnSend
from batchyard.work.runner import Answered, Failed

__all__ = ["Answer", "Plan", "call", "never_answered", "plan_for", "result"]


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
#: A Message Batch's lines: stored translated (``service.openai_requests``), answered as
#: Anthropic's ``message``.
MESSAGES = "/v1/messages"

log = logging.getLogger("batchyard.file_batches")

#: Why a line that no call answered ended, as OpenAI's error codes (and batchyard's).
NEVER_ANSWERED = {
    "expired": (
        "batch_expired",
        "This request could not be executed before the completion window expired.",
    ),
    "canceled": ("batch_cancelled", "The batch was cancelled before this request was sent."),
    "uncertain": (
        "uncertain",
        "The worker stopped while this request's call was in flight. It may have been answered "
        "upstream, so it was not sent again and was not charged; inspect Activity before you "
        "send it again.",
    ),
}


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a model's lines go and what they are charged: the route and its price."""

    model: ModelSpec
    route: RouteSpec
    price: Price
    direct: Price


def plan_for(
    catalog: Catalog,
    prices: MarketPrices,
    model_id: str,
    min_discount: Decimal | None,
    now: datetime,
) -> Plan | None:
    """The route for a model's lines now; None while none meets the batch's discount.

    Without ``min_discount`` a line goes to the model's route at its direct
    price, as a chat completion would. With one, it waits for the cheapest
    route whose fresh price meets the discount (the seed's rule, with hard
    price caps), exactly as a deferred item does.
    """
    model = catalog.find(model_id)
    if model is None or not catalog.is_available(model_id):
        return None
    direct = direct_price(model)
    if min_discount is None:
        return Plan(model, catalog.route_for(model_id), direct, direct)
    best = None
    for offer in prices.offers(model_id, now):
        if offer.price is None or not qualifies(offer, direct, min_discount):
            continue
        cost = offer_cost(offer, 1000, 1000)
        if best is None or cost < best[0]:
            best = (cost, offer)
    if best is None:
        return None
    offer = best[1]
    assert offer.price is not None
    return Plan(model, catalog.routes[offer.route], offer.price, direct)


def _line_id(now: datetime) -> str:
    return new_id("breq", now)


def _seal(sealer: Sealer, batch_id: str, line: int, obj: dict[str, Any]) -> tuple[bytes, int]:
    text = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    return sealer.seal(text, out_aad(batch_id, line)), len(text)


def never_answered(
    sealer: Sealer, batch_id: str, line: int, custom_id: str, state: str, now: datetime
) -> Ended:
    """A line ended without an answer: its error-file line."""
    code, message = NEVER_ANSWERED[state]
    out, size = _seal(
        sealer,
        batch_id,
        line,
        {
            "id": _line_id(now),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        },
    )
    return Ended(line, state, out, size)


def _request(endpoint: str, body: dict[str, Any], model: str, max_tokens: int) -> CompletionRequest:
    stop = body.get("stop")
    text_prompt = endpoint == COMPLETIONS
    prompt = (
        str(body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][0])
        if text_prompt
        else None
    )
    return CompletionRequest(
        model=model,
        messages=[{"role": "user", "content": prompt}] if text_prompt else body["messages"],
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=body.get("top_k"),
        n=int(body.get("n", 1)),
        stop=[stop] if isinstance(stop, str) else stop,
        seed=body.get("seed"),
        response_format=None if text_prompt else body.get("response_format"),
        logprobs=False if text_prompt else bool(body.get("logprobs", False)),
        top_logprobs=None if text_prompt else body.get("top_logprobs"),
    )


@dataclass(frozen=True, slots=True)
class Answer:
    """What a line's call came back with: its request body, usage, and the engine's answer."""

    body: dict[str, Any]
    usage: Usage
    answered: Any


def _unreadable() -> InternalError:
    return InternalError("the stored request cannot be read", retryable=False)


async def call(
    dispatcher: Dispatcher,
    sealer: Sealer,
    endpoint: str,
    input_file_id: str,
    claimed: Claimed,
    plan: Plan,
    on_send: OnSend,
) -> Answer:
    """The line's call, as its endpoint makes it; its body unsealed from the input file."""
    try:
        stored = json.loads(sealer.open(claimed.body, line_aad(input_file_id, claimed.line)))
        body = stored["body"]
        if endpoint == EMBEDDINGS:
            texts = [body["input"]] if isinstance(body["input"], str) else list(body["input"])
        else:
            n = max(1, int(body.get("n", 1)))
            name = engine_name(plan.model.id, plan.route)
            request = _request(endpoint, body, name, claimed.max_tokens // n)
    except (SealError, ValueError, KeyError, TypeError):
        raise _unreadable() from None
    if endpoint == EMBEDDINGS:
        result = await dispatcher.call_embed(
            route=plan.route, texts=texts, input_tokens=claimed.input_tokens, on_send=on_send
        )
        used = result.usage.input_tokens or claimed.input_tokens
        return Answer(body, Usage(used, 0), result)
    completion = await dispatcher.call(
        route=plan.route, request=request, input_tokens=claimed.input_tokens, on_send=on_send
    )
    return Answer(body, completion.usage, completion)


def _answer_body(
    endpoint: str,
    body: dict[str, Any],
    answered: Any,
    usage: Usage,
    request_id: str,
    now: datetime,
    plan: Plan,
) -> dict[str, Any]:
    """The answer in the shape the endpoint gives on the wire."""
    usage_json = {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }
    if endpoint == EMBEDDINGS:
        return {
            "object": "list",
            "data": embedding_data(answered.vectors, str(body.get("encoding_format", "float"))),
            "model": plan.model.id,
            "usage": {"prompt_tokens": usage.input_tokens, "total_tokens": usage.input_tokens},
        }
    if endpoint == MESSAGES:
        choice = answered.choices[0]
        return message_object(
            message_id=request_id,
            model=plan.model.id,
            text=choice.text,
            tool_calls=choice.tool_calls,
            finish_reason=choice.finish_reason,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
        )
    if endpoint == COMPLETIONS:
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(now.timestamp()),
            "model": plan.model.id,
            "choices": [
                {"index": i, "text": ch.text, "finish_reason": ch.finish_reason, "logprobs": None}
                for i, ch in enumerate(answered.choices)
            ],
            "usage": usage_json,
        }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(now.timestamp()),
        "model": plan.model.id,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": ch.text},
                "finish_reason": ch.finish_reason,
                "logprobs": {"content": ch.logprobs} if ch.logprobs is not None else None,
            }
            for i, ch in enumerate(answered.choices)
        ],
        "usage": usage_json,
    }


def result(
    sealer: Sealer,
    endpoint: str,
    batch_id: str,
    claimed: Claimed,
    plan: Plan,
    attempt: Answered[Answer] | Failed,
    now: datetime,
) -> Ended:
    """The line's end, rendered and sealed: its answer (charged), or its failure's error body."""
    if isinstance(attempt, Failed):
        err = attempt.error
        out, size = _seal(
            sealer,
            batch_id,
            claimed.line,
            {
                "id": _line_id(now),
                "custom_id": claimed.custom_id,
                "response": {"status_code": err.status, "request_id": None, "body": err.to_body()},
                "error": None,
            },
        )
        return Ended(claimed.line, "failed", out, size, route=plan.route.id)
    body, usage, answered = attempt.value.body, attempt.value.usage, attempt.value.answered
    cap = quote(plan.model, claimed.input_tokens, claimed.max_tokens)
    charge = min(charge_ticks(plan.price.cost(usage.input_tokens, usage.output_tokens)), cap)
    prefixes = {COMPLETIONS: "cmpl", EMBEDDINGS: "emb", MESSAGES: "msg"}
    request_id = new_id(prefixes.get(endpoint, "chatcmpl"), now)
    rendered = _answer_body(endpoint, body, answered, usage, request_id, now, plan)
    rendered["charge"] = format_money(charge)
    rendered["route"] = plan.route.id
    out, size = _seal(
        sealer,
        batch_id,
        claimed.line,
        {
            "id": _line_id(now),
            "custom_id": claimed.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": rendered},
            "error": None,
        },
    )
    return Ended(
        claimed.line,
        "succeeded",
        out,
        size,
        route=plan.route.id,
        usage_input=usage.input_tokens,
        usage_output=usage.output_tokens,
        charge=charge,
    )
