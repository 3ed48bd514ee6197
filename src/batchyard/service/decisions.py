"""Decide: every question about one text, answered in one call.

``prepare`` checks the body whole and plans the call before anything is claimed,
charged or counted, so a bad request is a 400 that leaves its idempotency key free.
``decide`` holds the dearer of the version's and (where it may fall back) its base's
quote, and settles to the usage of the model that answered; a model output that cannot
be read releases the hold. ``estimate`` quotes without running anything.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from batchyard.core import decisions as rules
from batchyard.core.accounts import Principal
from batchyard.core.calibration import CalibrationMode
from batchyard.core.catalog import ModelSpec
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.prices import Price
from batchyard.core.quotes import check_context, direct_price, quote
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.errors import (
    ContextWindowExceeded,
    InvalidRequest,
    ModelUnavailable,
    ModelWarming,
    NotFound,
    UnsupportedInput,
)
from batchyard.service import model_versions
from batchyard.service.deployment import Service
from batchyard.work import decide_scoring as scoring_work
from batchyard.work.decide_scoring import ScoredAnswers as _Scored
from batchyard.work.warmth import MAX_KEEP_WARM_MINUTES, Serving, serving

__all__ = [
    "LOAD_WAIT_BOUND_S",
    "Admit",
    "Plan",
    "Prepared",
    "WarmTarget",
    "decide",
    "estimate",
    "keep_warm",
    "prepare",
    "prepare_keep_warm",
]

log = logging.getLogger("batchyard.decide")

# With ``fallback: none``, how long a call waits for a version to load before
# it answers 503 model_warming (retryable; the load goes on).
LOAD_WAIT_BOUND_S = 60.0
# What OpenAI-compatible servers allow at most; enough to cover the outcomes.
TOP_LOGPROBS = 20
# Generated JSON may carry spaces and newlines the tightest answer does not.
GENERATION_SLACK_TOKENS = 16

#: The door's admission for a call of this many input tokens (its tier's
#: limits); it raises to refuse. The service decides when, the door how.
Admit = Callable[[int], Awaitable[None]]


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


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked request and its plans: the model asked for, and its base where it may fall back."""

    req: rules.DecideRequest
    primary: Plan
    fallback: Plan | None

    @property
    def max_cost(self) -> int:
        """The hold: the dearer of the two ways it may be answered."""
        return max(self.primary.max_cost, self.fallback.max_cost if self.fallback else 0)


def _plan(svc: Service, req: rules.DecideRequest, model: ModelSpec) -> Plan:
    if req.input.image_url is not None and not model.reads_images:
        raise UnsupportedInput(
            f"{model.id} reads text only; send images to kettei-chub or kettei-fat",
            param="input.image_url",
        )
    where = serving(svc.catalog, model)
    scoring = req.input.image_url is None and svc.dispatcher.can_score(where.route)
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
    n_in = tok.count_messages(messages)
    check_context(model, n_in, max_out, param="input.text", output="max_output_tokens")
    mode: CalibrationMode = req.calibration if scoring else "none"
    cost = quote(model, n_in, max_out)
    price = direct_price(model)
    return Plan(model, where, scoring, fmt, messages, n_in, max_out, price, cost, mode, n_in)


async def prepare(svc: Service, org_id: str, raw: dict[str, Any]) -> Prepared:
    """The checked request and its plans; raises the 400 (or 404) a bad body earns.

    ``raw`` is the body as the door read it (its fields already checked
    strictly); ``org_id`` is the caller's: only its own project model versions
    are found. Nothing is claimed, charged or counted here.
    """
    await model_versions.resolve(svc, raw.get("model"))
    model = svc.catalog.model(raw.get("model"), org_id)  # 404 before the rules between fields
    req = rules.parse_request(raw)
    primary = _plan(svc, req, model)
    fallback: Plan | None = None
    if model.type == "version" and req.fallback == "base" and model.base_model:
        try:
            fallback = _plan(svc, req, svc.catalog.model(model.base_model))
        except (ModelUnavailable, ContextWindowExceeded, UnsupportedInput, InvalidRequest):
            # The base cannot take this request here: the version waits instead.
            fallback = None
    return Prepared(req, primary, fallback)


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


async def _priced(svc: Service, org_id: str, call: Prepared) -> Prepared:
    """``prepare``'s plans with what calibration will cost this organisation now."""
    primary = await _with_prior(svc, org_id, call.req, call.primary)
    fallback = call.fallback and await _with_prior(svc, org_id, call.req, call.fallback)
    return Prepared(call.req, primary, fallback)


@dataclass(frozen=True, slots=True)
class _Answered:
    """Who answered (the plan used) and what it said."""

    plan: Plan
    scored: _Scored


async def _score(svc: Service, plan: Plan, req: rules.DecideRequest, caller: Principal) -> _Scored:
    tok = svc.tokenizer(plan.model)
    return await svc.calibrations.score(
        org_id=caller.org_id,
        model_id=plan.model.id,
        route=plan.serving.route,
        upstream_model=plan.serving.upstream_model,
        req=req,
        mode=plan.calibration,
        prompt_tokens=plan.prompt_tokens,
        count=tok.count_messages,
        count_text=tok.count,
        # Zero data retention: its texts never join the running mean.
        retain=not caller.zero_data_retention,
    )


async def _engine(
    svc: Service, plan: Plan, req: rules.DecideRequest, caller: Principal
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


async def _answer(svc: Service, call: Prepared, caller: Principal) -> _Answered:
    """Who answers, and what: the model asked for, or its base while a cold version loads."""
    req, primary, fallback = call.req, call.primary, call.fallback
    if primary.model.type != "version":
        return _Answered(primary, _read(primary, req, await _engine(svc, primary, req, caller)))
    wait_s = svc.settings.warm_fallback_after_s
    if fallback is None:
        wait_s = max(wait_s, LOAD_WAIT_BOUND_S)
    ok, result = await svc.warmth.run(
        primary.model.id, primary.serving, lambda: _engine(svc, primary, req, caller), wait_s=wait_s
    )
    if ok and result is not None:
        return _Answered(primary, _read(primary, req, result))
    if fallback is not None:
        log.info("fell back to the base model", extra={"model": primary.model.id})
        return _Answered(fallback, _read(fallback, req, await _engine(svc, fallback, req, caller)))
    raise ModelWarming(
        f"{primary.model.id} is still loading after {wait_s:g} s; send the request again "
        "with the same idempotency key, or keep the model warm first",
        retry_after=svc.settings.warm_fallback_after_s,
    )


async def _paid(
    svc: Service, caller: Principal, decision_id: str, call: Prepared
) -> tuple[_Answered, int]:
    """Decide's call, paid through ``Dispatcher.paying``; the charge in ticks.

    The hold is the dearer plan's quote; a failure of any kind (a cancelled
    request included) releases it; the settlement is the usage at the price
    and route of the plan that answered (the base model's, after a fallback).
    """
    first = call.primary
    async with svc.dispatcher.paying(
        caller.org_id,
        call.max_cost,
        model=first.model,
        route=first.serving.route,
        price=first.price,
        purpose="decide",
        ref=decision_id,
        key_id=caller.key_id,
    ) as pay:
        got = await _answer(svc, call, caller)
        used = got.plan
        charged = await pay.settle(
            got.scored.usage,
            {
                "decisions": len(call.req.decisions),
                "calibration_input_tokens": got.scored.calibration_input_tokens,
            },
            model=used.model,
            route=used.serving.route,
            price=used.price,
        )
    return got, charged


async def decide(
    svc: Service, principal: Principal, call: Prepared, admit: Admit
) -> dict[str, Any]:
    """Answer every decision of ``call`` about its text, paid once; the answer's JSON.

    ``admit`` is called with the call's input tokens (its content-free
    estimate included, where this call makes it) before anything is held.
    """
    call = await _priced(svc, principal.org_id, call)
    await admit(call.primary.input_tokens)
    decision_id = new_id("dec", svc.clock.now())
    got, charged = await _paid(svc, principal, decision_id, call)
    req, used, answered = call.req, got.plan, got.scored
    fell_back = used is not call.primary
    log.info(
        "decided",
        extra={
            "org_id": principal.org_id,
            "model": used.model.id,
            "decisions": len(req.decisions),
            "fallback": fell_back,
        },
    )
    usage = answered.usage
    return {
        "id": decision_id,
        "model": call.primary.model.id,
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


async def estimate(svc: Service, org_id: str, call: Prepared, admit: Admit) -> dict[str, Any]:
    """What ``decide`` would read and the most it could charge; nothing is run or held."""
    call = await _priced(svc, org_id, call)
    primary = call.primary
    await admit(primary.input_tokens)
    return {
        "input_tokens": primary.input_tokens,
        "max_output_tokens": primary.max_output_tokens,
        "max_cost": format_money(call.max_cost),
        "calibration_input_tokens": primary.content_free_tokens,
        "content_free_input_tokens": primary.content_free_tokens if primary.prior_pending else 0,
    }


@dataclass(frozen=True, slots=True)
class WarmTarget:
    """A fine-tuned version to keep loaded, where it is served, and for how long."""

    model_id: str
    serving: Serving
    minutes: float


async def prepare_keep_warm(svc: Service, org_id: str, model_id: str, minutes: float) -> WarmTarget:
    """The checked keep-warm request: 404 for a model the caller cannot see, 400 for the rest."""
    await model_versions.resolve(svc, model_id)
    model = svc.catalog.find(model_id, org_id)
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
    return WarmTarget(model.id, serving(svc.catalog, model), float(minutes))


def keep_warm(svc: Service, target: WarmTarget) -> dict[str, Any]:
    """Keep the version loaded for ``target.minutes`` from now; the model object with its warmth."""
    view = svc.warmth.keep_warm(target.model_id, target.serving, target.minutes)
    return {"id": target.model_id, "object": "model", "warm": view.to_json()}
