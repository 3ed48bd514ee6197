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

LEAD: ``answer`` calls the dispatcher for ``/v1/chat/completions`` lines; when
issue 12 gives the dispatcher completions and embeddings calls, add them here
and to ``service.openai_requests.EXECUTABLE``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.ids import new_id
from batchyard.core.market import offer_cost, qualifies
from batchyard.core.money import charge_ticks, format_money, quote_ticks
from batchyard.core.prices import Price
from batchyard.core.sealing import Sealer, SealError
from batchyard.engines.base import CompletionRequest
from batchyard.errors import BatchyardError, InternalError, UpstreamError
from batchyard.store.file_batches import Claimed, Ended, out_aad
from batchyard.store.files import line_aad
from batchyard.work.batches.prices import MarketPrices
from batchyard.work.dispatcher import Dispatcher, OnSend

__all__ = ["NotSent", "Plan", "answer", "never_answered", "plan_for"]


class NotSent(Exception):
    """Raised by an ``on_send`` that refuses the call: the line waits again."""


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
    model = catalog.models.get(model_id)
    if model is None or not catalog.is_available(model_id):
        return None
    direct = Price(model.input_per_mtok, model.output_per_mtok)
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


def _chat_request(body: dict[str, Any], route: RouteSpec, max_tokens: int) -> CompletionRequest:
    stop = body.get("stop")
    return CompletionRequest(
        model=route.upstream_model,
        messages=body["messages"],
        max_tokens=max_tokens,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        n=int(body.get("n", 1)),
        stop=[stop] if isinstance(stop, str) else stop,
        seed=body.get("seed"),
        response_format=body.get("response_format"),
        logprobs=bool(body.get("logprobs", False)),
        top_logprobs=body.get("top_logprobs"),
    )


async def answer(
    *,
    dispatcher: Dispatcher,
    sealer: Sealer,
    batch_id: str,
    input_file_id: str,
    claimed: Claimed,
    plan: Plan,
    now_of: Any,
    on_send: OnSend | None = None,
) -> Ended | None:
    """Call one line and render its result; never raises (a failure is a result too).

    None when the call was never made (``on_send`` refused: the worker is
    stopping, or the line is no longer its own): the line waits again.
    """
    request_id: str | None = None
    err: BatchyardError | None = None
    try:
        stored = json.loads(sealer.open(claimed.body, line_aad(input_file_id, claimed.line)))
        body = stored["body"]
        n = max(1, int(body.get("n", 1)))
        request = _chat_request(body, plan.route, claimed.max_tokens // n)
    except (SealError, ValueError, KeyError, TypeError):
        err = InternalError("the stored request cannot be read", retryable=False)
    if err is None:
        sent = False

        async def mark() -> None:
            nonlocal sent
            if on_send is not None:
                await on_send()
            sent = True

        try:
            completion = await dispatcher.call(
                route=plan.route, request=request, input_tokens=claimed.input_tokens, on_send=mark
            )
        except NotSent:
            return None
        except BatchyardError as exc:
            if not sent:
                return None  # nothing reached the engine (the store refused the mark)
            err = exc
        except Exception as exc:
            log.warning("batch line failed", extra={"error_type": type(exc).__name__})
            if not sent:
                return None
            err = UpstreamError(f"the engine failed ({type(exc).__name__})")
    if err is not None:
        now = now_of()
        out, size = _seal(
            sealer,
            batch_id,
            claimed.line,
            {
                "id": _line_id(now),
                "custom_id": claimed.custom_id,
                "response": {
                    "status_code": err.status,
                    "request_id": request_id,
                    "body": err.to_body(),
                },
                "error": None,
            },
        )
        return Ended(claimed.line, "failed", out, size, route=plan.route.id)
    now = now_of()
    usage = completion.usage
    cap = quote_ticks(plan.direct.cost(claimed.input_tokens, claimed.max_tokens))
    charge = min(charge_ticks(plan.price.cost(usage.input_tokens, usage.output_tokens)), cap)
    request_id = new_id("chatcmpl", now)
    result = {
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
            for i, ch in enumerate(completion.choices)
        ],
        "usage": {
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.total_tokens,
        },
        "charge": format_money(charge),
        "route": plan.route.id,
    }
    out, size = _seal(
        sealer,
        batch_id,
        claimed.line,
        {
            "id": _line_id(now),
            "custom_id": claimed.custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": result},
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
