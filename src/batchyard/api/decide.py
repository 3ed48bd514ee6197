"""``POST /v1/decide``: every question about one text, answered in one call.

The body is checked whole before anything is claimed, charged or counted, so a
bad request is a 400 that leaves its idempotency key free for the fixed body.
Then, inside the idempotent handler: the tier's limits, a hold for the most
expensive outcome (the version's price or, where it may fall back, the base
model's, whichever is higher), the model call, and settlement to the real
usage at the price of the model that answered (prompt tokens the engine read
from its cache at the route's cached-input price, as every settlement does).

A model output that cannot be read (``model_output_invalid``) releases the
hold: nothing is charged for a call that gave no answer. Like every
non-retryable failure it is saved under the idempotency key.

``POST /v1/decide/estimate`` builds the same prompt, counts it with the
model's tokenizer and quotes the most the call can cost, without running a
model or charging anything. ``POST /v1/models/{id}/keep-warm`` keeps a
fine-tuned version loaded for a while.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.bodies import DecideBody, KeepWarmBody
from batchyard.api.context import (
    authenticate,
    check_tier_limits,
    idempotent,
    read_json,
    service_of,
)
from batchyard.api.inputs import strict
from batchyard.core import decisions as rules
from batchyard.core.calibration import CalibrationMode
from batchyard.core.catalog import ModelSpec, RouteSpec
from batchyard.core.ids import new_id
from batchyard.core.money import charge_ticks, format_money
from batchyard.core.prices import Price
from batchyard.core.quotes import check_context, direct_price, quote
from batchyard.engines.protocol import Completion, CompletionRequest, Usage
from batchyard.errors import (
    ContextWindowExceeded,
    InvalidRequest,
    ModelUnavailable,
    ModelWarming,
    NotFound,
    UnsupportedInput,
)
from batchyard.service import Service, model_versions
from batchyard.work import decide_scoring as scoring_work
from batchyard.work.decide_scoring import CalibrationInfo
from batchyard.work.dispatcher import settled_cost
from batchyard.work.warmth import MAX_KEEP_WARM_MINUTES, Serving, serving

__all__ = ["LOAD_WAIT_BOUND_S", "Plan", "can_score", "prepare", "priced", "router"]

router = APIRouter()
log = logging.getLogger("batchyard.decide")

# With ``fallback: none``, how long a call waits for a version to load before
# it answers 503 model_warming (retryable; the load goes on).
LOAD_WAIT_BOUND_S = 60.0
# What OpenAI-compatible servers allow at most; enough to cover the outcomes.
TOP_LOGPROBS = 20
# Generated JSON may carry spaces and newlines the tightest answer does not.
GENERATION_SLACK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Plan:
    """One model's way to answer the request, and the most it can cost."""

    model: ModelSpec
    serving: Serving
    scoring: bool
    fmt: rules.AnswerFormat
    messages: list[dict[str, Any]]
    input_tokens: int
    max_output_tokens: int
    price: Price
    max_cost: int
    # Calibration as it applies here ("none" where the engine cannot score),
    # the prompt's tokens, and, where this call would estimate the set's
    # content-free prior (``prior_pending``), what that costs; then
    # ``input_tokens`` includes it.
    calibration: CalibrationMode = "none"
    prompt_tokens: int = 0
    content_free_tokens: int = 0
    prior_pending: bool = False

    @property
    def calibration_input_tokens(self) -> int:
        return self.content_free_tokens


def can_score(svc: Service, route: RouteSpec) -> bool:
    """Whether the route's engine scores candidate replies (decide's scoring path)."""
    return svc.dispatcher.can_score(route)


def _plan(svc: Service, req: rules.DecideRequest, model: ModelSpec) -> Plan:
    if req.input.image_url is not None and not model.reads_images:
        raise UnsupportedInput(
            f"{model.id} reads text only; send images to kettei-chub or kettei-fat",
            param="input.image_url",
        )
    where = serving(svc.catalog, model)
    scoring = req.input.image_url is None and can_score(svc, where.route)
    fmt: rules.AnswerFormat = (
        "json" if not scoring and where.route.supports_json_schema else "lines"
    )
    messages = rules.build_messages(req, fmt)
    tok = svc.tokenizer(model)
    need = rules.needed_output_tokens(req.decisions, fmt, tok.count)
    if req.max_output_tokens is None:
        max_out = need if scoring else need + GENERATION_SLACK_TOKENS
        max_out = min(max_out, model.max_output_tokens)
    else:
        max_out = req.max_output_tokens
    if not need <= max_out <= model.max_output_tokens:
        raise InvalidRequest(
            f"max_output_tokens must be between {need} (the longest answer to these "
            f"decisions) and {model.max_output_tokens} for {model.id}",
            param="max_output_tokens",
            code="max_output_tokens_out_of_range",
        )
    prompt_tokens = tok.count_messages(messages)
    check_context(model, prompt_tokens, max_out, param="input.text", output="max_output_tokens")
    price = direct_price(model)
    mode: CalibrationMode = req.calibration if scoring else "none"
    max_cost = quote(model, prompt_tokens, max_out)
    return Plan(
        model,
        where,
        scoring,
        fmt,
        messages,
        prompt_tokens,
        max_out,
        price,
        max_cost,
        mode,
        prompt_tokens,
    )


async def _with_prior(svc: Service, org_id: str, req: rules.DecideRequest, plan: Plan) -> Plan:
    """The plan, priced with the content-free estimate where this call would make it."""
    if plan.calibration == "none" or plan.prior_pending:
        return plan
    if await svc.calibrations.prior_known(org_id, plan.model.id, req):
        return plan
    count = svc.tokenizer(plan.model).count_messages
    content_free = sum(
        count(rules.build_messages(cf, plan.fmt)) for cf in scoring_work.content_free_requests(req)
    )
    input_tokens = plan.input_tokens + content_free
    return dataclasses.replace(
        plan,
        input_tokens=input_tokens,
        content_free_tokens=content_free,
        max_cost=quote(plan.model, input_tokens, plan.max_output_tokens),
        prior_pending=True,
    )


async def priced(
    svc: Service, org_id: str, req: rules.DecideRequest, primary: Plan, fallback: Plan | None
) -> tuple[Plan, Plan | None]:
    """``prepare``'s plans with what calibration will cost this organisation now."""
    primary = await _with_prior(svc, org_id, req, primary)
    if fallback is not None:
        fallback = await _with_prior(svc, org_id, req, fallback)
    return primary, fallback


def prepare(
    svc: Service, raw: dict[str, Any], org_id: str | None = None
) -> tuple[rules.DecideRequest, Plan, Plan | None]:
    """The checked request, its plan, and the base model's plan where it may fall back.

    ``org_id`` is the caller's: only its own project model versions are found.
    """
    req = rules.parse_request(raw)
    model = svc.catalog.model(req.model, org_id)
    primary = _plan(svc, req, model)
    fallback: Plan | None = None
    if model.type == "version" and req.fallback == "base" and model.base_model:
        try:
            fallback = _plan(svc, req, svc.catalog.model(model.base_model))
        except (ModelUnavailable, ContextWindowExceeded, UnsupportedInput, InvalidRequest):
            # The base cannot take this request here: the version waits instead.
            fallback = None
    return req, primary, fallback


@dataclass(frozen=True, slots=True)
class _Scored:
    chosen: list[str]
    probabilities: Sequence[dict[str, float] | None]
    usage: Usage
    raw: list[dict[str, float]] | None = None
    calibration_input_tokens: int = 0
    calibration: CalibrationInfo | None = None


@dataclass(frozen=True, slots=True)
class _Caller:
    org_id: str
    # False for zero data retention: its texts never join the running mean.
    retain: bool


async def _score(svc: Service, plan: Plan, req: rules.DecideRequest, caller: _Caller) -> _Scored:
    tok = svc.tokenizer(plan.model)
    got = await svc.calibrations.score(
        org_id=caller.org_id,
        model_id=plan.model.id,
        route=plan.serving.route,
        upstream_model=plan.serving.upstream_model,
        req=req,
        mode=plan.calibration,
        prompt_tokens=plan.prompt_tokens,
        count=tok.count_messages,
        count_text=tok.count,
        retain=caller.retain,
    )
    return _Scored(
        got.chosen,
        got.probabilities,
        got.usage,
        got.raw,
        got.calibration_input_tokens,
        got.calibration,
    )


async def _engine(
    svc: Service, plan: Plan, req: rules.DecideRequest, caller: _Caller
) -> _Scored | Completion:
    """The model's work, unbilled: billing wraps it, and a load given up on bills no one."""
    if plan.scoring:
        return await _score(svc, plan, req, caller)
    request = CompletionRequest(
        model=plan.serving.upstream_model,
        messages=plan.messages,
        max_tokens=plan.max_output_tokens,
        temperature=0.0,
        response_format=rules.response_format(req.decisions) if plan.fmt == "json" else None,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
    )
    return await svc.dispatcher.call(
        route=plan.serving.route, request=request, input_tokens=plan.input_tokens
    )


def _read(plan: Plan, req: rules.DecideRequest, result: _Scored | Completion) -> _Scored:
    if isinstance(result, _Scored):
        return result
    chosen = rules.parse_output(result.text, req.decisions, plan.fmt)
    logprobs = result.choices[0].logprobs if result.choices else None
    probabilities = rules.logprob_probabilities(result.text, logprobs, req.decisions, plan.fmt)
    return _Scored(chosen, probabilities, result.usage)


async def _answer(
    svc: Service, req: rules.DecideRequest, primary: Plan, fallback: Plan | None, caller: _Caller
) -> tuple[Plan, _Scored | Completion]:
    """Who answers: the model asked for, or its base while a cold version loads."""
    if primary.model.type != "version":
        return primary, await _engine(svc, primary, req, caller)
    warmth = svc.warmth
    wait_s = svc.settings.warm_fallback_after_s
    if fallback is None:
        wait_s = max(wait_s, LOAD_WAIT_BOUND_S)
    ok, result = await warmth.run(
        primary.model.id, primary.serving, lambda: _engine(svc, primary, req, caller), wait_s=wait_s
    )
    if ok and result is not None:
        return primary, result
    if fallback is not None:
        log.info("fell back to the base model", extra={"model": primary.model.id})
        return fallback, await _engine(svc, fallback, req, caller)
    raise ModelWarming(
        f"{primary.model.id} is still loading after {wait_s:g} s; send the request again "
        "with the same idempotency key, or keep the model warm first",
        retry_after=svc.settings.warm_fallback_after_s,
    )


async def _decide(
    svc: Service,
    caller: _Caller,
    req: rules.DecideRequest,
    primary: Plan,
    fallback: Plan | None,
) -> dict[str, Any]:
    org_id = caller.org_id
    now = svc.clock.now()
    decision_id = new_id("dec", now)
    hold = max(primary.max_cost, fallback.max_cost if fallback else 0)
    res = await svc.dispatcher.reserve(org_id, hold, purpose="decide", ref=decision_id)
    try:
        used, result = await _answer(svc, req, primary, fallback, caller)
        answered = _read(used, req, result)
    except BaseException as exc:
        reason = str(getattr(exc, "code", type(exc).__name__))
        await asyncio.shield(svc.dispatcher.release(res.id, reason=reason))
        raise
    usage = answered.usage
    charged = await svc.dispatcher.settle(
        reservation_id=res.id,
        charge=charge_ticks(settled_cost(used.price, used.serving.route, usage)),
        model=used.model.id,
        route=used.serving.route.id,
        usage=usage,
        purpose="decide",
        ref=decision_id,
        detail={
            "decisions": len(req.decisions),
            "calibration_input_tokens": answered.calibration_input_tokens,
        },
    )
    fell_back = used is not primary
    log.info(
        "decided",
        extra={
            "org_id": org_id,
            "model": used.model.id,
            "decisions": len(req.decisions),
            "fallback": fell_back,
        },
    )
    return {
        "id": decision_id,
        "model": primary.model.id,
        "answers": rules.answers_json(
            req.decisions, answered.chosen, answered.probabilities, answered.raw
        ),
        "usage": {
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cached_input_tokens": usage.cached_input_tokens,
            "calibration_input_tokens": answered.calibration_input_tokens,
        },
        "charge": format_money(charged),
        "fallback": {"reason": "model_warming", "model": used.model.id} if fell_back else None,
        "calibration": answered.calibration.to_json() if answered.calibration else None,
    }


@router.post("/v1/decide")
async def decide(request: Request) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    strict(DecideBody, raw)
    svc = service_of(request)
    await model_versions.resolve(svc, raw.get("model"))
    req, primary, fallback = prepare(svc, raw, principal.org_id)

    async def handler() -> tuple[int, Any]:
        first, base = await priced(svc, principal.org_id, req, primary, fallback)
        await check_tier_limits(request, principal, requests=1, tokens=first.input_tokens)
        caller = _Caller(principal.org_id, retain=not principal.zero_data_retention)
        return 200, await _decide(svc, caller, req, first, base)

    return await idempotent(request, principal, raw, handler)


@router.post("/v1/decide/estimate")
async def estimate(request: Request) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    strict(DecideBody, raw)
    svc = service_of(request)
    await model_versions.resolve(svc, raw.get("model"))
    req, first_plan, fallback_plan = prepare(svc, raw, principal.org_id)

    async def handler() -> tuple[int, Any]:
        primary, fallback = await priced(svc, principal.org_id, req, first_plan, fallback_plan)
        await check_tier_limits(
            request, principal, requests=1, tokens=primary.input_tokens, kind="estimate"
        )
        max_cost = max(primary.max_cost, fallback.max_cost if fallback else 0)
        return 200, {
            "input_tokens": primary.input_tokens,
            "max_output_tokens": primary.max_output_tokens,
            "max_cost": format_money(max_cost),
            "calibration_input_tokens": primary.calibration_input_tokens,
            "content_free_input_tokens": (
                primary.content_free_tokens if primary.prior_pending else 0
            ),
        }

    return await idempotent(request, principal, raw, handler)


@router.post("/v1/models/{model_id}/keep-warm")
async def keep_warm(request: Request, model_id: str) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    minutes = strict(KeepWarmBody, raw).minutes
    svc = service_of(request)
    await model_versions.resolve(svc, model_id)
    model = svc.catalog.find(model_id, principal.org_id)
    if model is None:
        raise NotFound(f"model {model_id!r} not found")
    if model.type != "version":
        raise InvalidRequest(
            f"{model.id} is a base model and is always served; keep-warm is for "
            "fine-tuned versions",
            param="model",
            code="not_a_model_version",
        )
    if not 0 < minutes <= MAX_KEEP_WARM_MINUTES:
        raise InvalidRequest(
            f"minutes must be a number above 0 and at most {MAX_KEEP_WARM_MINUTES}",
            param="minutes",
            code="minutes_out_of_range",
        )
    where = serving(svc.catalog, model)

    async def handler() -> tuple[int, Any]:
        view = svc.warmth.keep_warm(model.id, where, float(minutes))
        return 200, {"id": model.id, "object": "model", "warm": view.to_json()}

    return await idempotent(request, principal, raw, handler)
