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

A line is answered as its endpoint would answer it on the wire, by the same
functions (``work.openai_wire``): its stored body is read back as the door's
own typed request, sent as the door sends it, and its answer is the door's
body (a chat completion, a text completion, embeddings, or Anthropic's
message), with the line's ``charge`` and ``route`` added; its charge is its
share of the batch's one hold, summed when the batch settles. The runner
(``work.runner``) makes the call (``call``) and hands its answer or its
failure to ``result``, which renders the line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from batchyard.core.anthropic_bodies import Translated
from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec, engine_name
from batchyard.core.ids import new_id
from batchyard.core.market import Item, Policy, offer_cost, qualifies
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import ChatRequest, CompletionTextRequest, EmbeddingRequest
from batchyard.core.prices import Price
from batchyard.core.quotes import charge, direct_price
from batchyard.core.sealing import Sealer, SealError
from batchyard.engines.protocol import Completion, Embeddings, Usage
from batchyard.engines.token_ids import as_texts
from batchyard.errors import InternalError
from batchyard.store.file_batches import RUN_TIME, Claimed, LineEnd, out_aad, waits_until
from batchyard.store.files import line_aad
from batchyard.work.dispatcher import Dispatcher, OnSend
from batchyard.work.market_prices import MarketPrices
from batchyard.work.openai_wire import (
    LineRequest,
    Reply,
    anthropic_message,
    chat_request,
    embedding_list,
    line_request,
    messages_request,
    text_requests,
)
from batchyard.work.runner import Answered, Failed

__all__ = [
    "RUN_TIME",
    "LineAnswer",
    "LinePlan",
    "call",
    "never_answered",
    "plan_by_policy",
    "plan_for",
    "result",
    "waits_until",
]

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
class LinePlan:
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
) -> LinePlan | None:
    """The route for a model's lines now; None while none meets the batch's discount.

    Without ``min_discount`` a line goes to the model's route at its direct
    price, as a chat completion would. With one, it waits for the cheapest
    route whose fresh price meets the discount (the deferred batches' rule, with hard
    price caps), exactly as a deferred item does.
    """
    model = catalog.find(model_id)
    if model is None or not catalog.is_available(model_id):
        return None
    direct = direct_price(model)
    if min_discount is None:
        return LinePlan(model, catalog.route_for(model_id), direct, direct)
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
    return LinePlan(model, catalog.routes[offer.route], offer.price, direct)


def plan_by_policy(
    catalog: Catalog,
    prices: MarketPrices,
    policy: Policy,
    item: Item,
    model_id: str,
    now: datetime,
) -> LinePlan | None:
    """The route the deferred batches' policy picks for a model's lines now, or None: wait.

    ``item`` stands for the batch's lines of ``model_id`` (its deadline the end
    of their wait). As for a deferred item, the policy only narrows the rule
    (``qualifies``), and a line is charged the chosen route's offered price.
    """
    model = catalog.find(model_id)
    if model is None or not catalog.is_available(model_id):
        return None
    direct = prices.direct(model_id)
    offer = policy.choose(item, prices.offers(model_id, now), direct, now)
    if offer is None or offer.price is None or not qualifies(offer, direct, item.min_discount):
        return None
    return LinePlan(model, catalog.routes[offer.route], offer.price, direct)


def _line_id(now: datetime) -> str:
    return new_id("breq", now)


def _result_line(
    sealer: Sealer,
    batch_id: str,
    line: int,
    custom_id: str,
    now: datetime,
    *,
    response: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> tuple[bytes, int]:
    """A line of the output or error file, sealed: the answer's ``response`` or an ``error``."""
    obj = {"id": _line_id(now), "custom_id": custom_id, "response": response, "error": error}
    text = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    return sealer.seal(text, out_aad(batch_id, line)), len(text)


def never_answered(
    sealer: Sealer, batch_id: str, line: int, custom_id: str, state: str, now: datetime
) -> LineEnd:
    """A line ended without an answer: its error-file line."""
    code, message = NEVER_ANSWERED[state]
    error = {"code": code, "message": message}
    out, size = _result_line(sealer, batch_id, line, custom_id, now, error=error)
    return LineEnd(line, state, out, size)


@dataclass(frozen=True, slots=True)
class LineAnswer:
    """What a line's call came back with: its typed request, usage, and the engine's answer."""

    request: LineRequest
    usage: Usage
    answered: Completion | Embeddings


async def call(
    dispatcher: Dispatcher,
    sealer: Sealer,
    endpoint: str,
    input_file_id: str,
    claimed: Claimed,
    plan: LinePlan,
    on_send: OnSend,
) -> LineAnswer:
    """The line's call, sent as its door sends it; its body unsealed from the input file
    and read back as the door's own typed request."""
    try:
        stored = json.loads(sealer.open(claimed.body, line_aad(input_file_id, claimed.line)))
        request = line_request(endpoint, stored["body"])
    except (SealError, ValueError, KeyError, TypeError):
        raise InternalError("the stored request cannot be read", retryable=False) from None
    if isinstance(request, EmbeddingRequest):
        texts = as_texts(request.inputs(), "input")
        result = await dispatcher.call_embed(
            route=plan.route, texts=texts, input_tokens=claimed.input_tokens, on_send=on_send
        )
        used = result.usage.input_tokens or claimed.input_tokens
        return LineAnswer(request, Usage(used, 0), Embeddings(result.vectors, Usage(used, 0)))
    name = engine_name(plan.model.id, plan.route)
    if isinstance(request, Translated):
        engine_request = messages_request(request, model=name)
    else:
        # The hold's output tokens are max_tokens for each of n samples.
        max_tokens = claimed.max_tokens // max(1, request.n)
        if isinstance(request, ChatRequest):
            engine_request = chat_request(request, model=name, max_tokens=max_tokens)
        else:
            prompts = as_texts(request.prompts(), "prompt")
            (engine_request,) = text_requests(request, prompts, model=name, max_tokens=max_tokens)
    completion = await dispatcher.call(
        route=plan.route, request=engine_request, input_tokens=claimed.input_tokens, on_send=on_send
    )
    return LineAnswer(request, completion.usage, completion)


def _answer_body(
    request: LineRequest, answered: Completion | Embeddings, reply: Reply
) -> dict[str, Any]:
    """The answer as the line's door gives it on the wire."""
    if isinstance(answered, Embeddings):
        assert isinstance(request, EmbeddingRequest)
        return embedding_list(request, reply.model, answered.vectors, answered.usage)
    if isinstance(request, Translated):
        stops = request.stop
        return anthropic_message(id=reply.id, model=reply.model, completion=answered, stops=stops)
    if isinstance(request, CompletionTextRequest):
        return reply.text(answered, request, as_texts(request.prompts(), "prompt"))
    assert isinstance(request, ChatRequest)
    return reply.chat(answered, logprobs=bool(request.logprobs))


_ID_PREFIXES = {
    ChatRequest: "chatcmpl",
    CompletionTextRequest: "cmpl",
    EmbeddingRequest: "emb",
    Translated: "msg",
}


def result(
    sealer: Sealer,
    batch_id: str,
    claimed: Claimed,
    plan: LinePlan,
    attempt: Answered[LineAnswer] | Failed,
    now: datetime,
) -> LineEnd:
    """The line's end, rendered and sealed: its answer (charged), or its failure's error body."""
    if isinstance(attempt, Failed):
        err = attempt.error
        # A failed call's answer is its error body, with no request ID (nothing answered it).
        failed = {"status_code": err.status, "request_id": None, "body": err.to_body()}
        out, size = _result_line(
            sealer, batch_id, claimed.line, claimed.custom_id, now, response=failed
        )
        return LineEnd(claimed.line, "failed", out, size, route=plan.route.id)
    request, usage, answered = attempt.value.request, attempt.value.usage, attempt.value.answered
    ticks = charge(plan.price, plan.route, usage).ticks
    # The same usage at the direct price, every prompt token uncached, as the quote priced it.
    direct_ticks = charge(plan.direct, None, usage).ticks
    request_id = new_id(_ID_PREFIXES[type(request)], now)
    reply = Reply(request_id, int(now.timestamp()), plan.model.id)
    body = {**_answer_body(request, answered, reply), "charge": format_money(ticks)}
    answered_line = {
        "status_code": 200,
        "request_id": request_id,
        "body": {**body, "route": plan.route.id},
    }
    out, size = _result_line(
        sealer, batch_id, claimed.line, claimed.custom_id, now, response=answered_line
    )
    return LineEnd(
        claimed.line,
        "succeeded",
        out,
        size,
        route=plan.route.id,
        usage_input=usage.input_tokens,
        usage_output=usage.output_tokens,
        charge=ticks,
        direct_charge=direct_ticks,
    )
