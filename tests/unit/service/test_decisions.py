"""``service.decisions`` called directly, with no HTTP in between: check, admit, pay once.

The door's part (authentication, strict bodies, the Idempotency-Key, the tier
limits) is tested over HTTP in ``tests/integration/api/test_decide.py``; here
the service is handed a caller and an ``admit`` of the test's own, so what it
promises the door can be seen on its own: nothing is held before the body is
checked and admitted, a call that gives no answer is charged nothing, and the
charge is the usage at the price of the model that answered.
"""

from __future__ import annotations

import asyncio
import math
from decimal import Decimal
from typing import Any

import pytest

from batchyard.core.accounts import Principal
from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec, default_catalog
from batchyard.core.money import charge_ticks, to_ticks, token_cost
from batchyard.core.quotes import quote
from batchyard.engines.protocol import Choice, Completion, CompletionRequest, Usage
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import (
    BatchyardError,
    InvalidRequest,
    ModelOutputInvalid,
    ModelWarming,
    NotFound,
    RateLimited,
)
from batchyard.service import Service, decisions
from batchyard.store import accounts, ledger
from tests.support.accounts import make_account
from tests.support.services import ServiceFactory
from tests.support.waits import until

SENTIMENT = {
    "id": "sentiment",
    "question": "How does the writer feel about the product?",
    "outcomes": [{"id": "positive"}, {"id": "negative"}, {"id": "neutral"}],
}
BODY: dict[str, Any] = {
    "model": "kettei-core",
    "input": {"text": "The battery died after two days; negative."},
    "decisions": [SENTIMENT],
}
CORE = (Decimal("0.10"), Decimal("0.40"))
VERSION = "kettei-core-acme"


def principal(svc: Service, name: str = "acme", credit: str = "1") -> Principal:
    acct = make_account(svc, name, credit=credit)
    found = svc.db.read_sync(lambda c: accounts.authenticate(c, acct.key))
    assert found is not None
    return found


def balance(svc: Service, org_id: str) -> ledger.Balance:
    return svc.db.read_sync(lambda c: ledger.balance(c, org_id))


class Admissions:
    """The door's ``admit``: records what it was asked, and what was held at that moment."""

    def __init__(self, svc: Service, org_id: str, refuse: BatchyardError | None = None) -> None:
        self.svc, self.org_id, self.refuse = svc, org_id, refuse
        self.asked: list[tuple[int, int]] = []

    async def __call__(self, tokens: int) -> None:
        self.asked.append((tokens, balance(self.svc, self.org_id).held))
        if self.refuse is not None:
            raise self.refuse


def scorer(model: str, messages: list[dict[str, Any]], candidates: list[str]) -> list[float]:
    """Favour the outcome the text names (this one says "negative")."""
    text = str(messages[-1]["content"]).split("Text:\n")[-1].lower()
    return [math.log(0.9) if c.rsplit(": ", 1)[-1] in text else math.log(0.05) for c in candidates]


@pytest.fixture
def engine(service: Service) -> ScriptedEngine:
    eng = ScriptedEngine(clock=service.clock, scorer=scorer)
    service.engines.set("embedded", eng)
    return eng


async def test_a_decision_is_admitted_before_the_hold_and_charged_its_usage(service, engine):
    who = principal(service)
    call = await decisions.prepare(service, who.org_id, BODY)
    est = await decisions.estimate(service, who.org_id, call, Admissions(service, who.org_id))
    admit = Admissions(service, who.org_id)
    answer = await decisions.decide(service, who, call, admit)
    assert answer["answers"][0]["outcome"] == "negative" and answer["fallback"] is None
    # Admitted once, for what the call reads as the model's tokenizer counts it
    # (calibration's content-free texts included), while nothing was held yet.
    assert est["content_free_input_tokens"] > 0
    assert admit.asked == [(est["input_tokens"], 0)]
    # Charged its usage (the scripted engine's count) at kettei-core's price, and nothing held.
    usage = answer["usage"]
    assert usage["calibration_input_tokens"] > 0
    ticks = charge_ticks(token_cost(usage["input_tokens"], usage["output_tokens"], *CORE))
    assert to_ticks(Decimal(answer["charge"])) == ticks
    bal = balance(service, who.org_id)
    assert bal.held == 0 and bal.settled == ticks


async def test_the_estimate_is_the_hold_decide_takes_and_charges_nothing(service, engine):
    who = principal(service)
    call = await decisions.prepare(service, who.org_id, BODY)
    est = await decisions.estimate(service, who.org_id, call, Admissions(service, who.org_id))
    primary = call.primary
    # The plan before pricing is the prompt alone; the estimate adds the prior it would make.
    assert est["input_tokens"] == primary.input_tokens + est["content_free_input_tokens"] > 0
    assert est["max_output_tokens"] == primary.max_output_tokens
    held = quote(primary.model, est["input_tokens"], est["max_output_tokens"])
    assert to_ticks(Decimal(est["max_cost"])) == held
    assert engine.score_calls == [] and balance(service, who.org_id).settled == 0


@pytest.mark.parametrize(
    ("change", "error", "code"),
    [
        ({"decisions": []}, InvalidRequest, "no_decisions"),
        ({"max_output_tokens": 100_000}, InvalidRequest, "max_output_tokens_out_of_range"),
        ({"model": "kettei-nope"}, InvalidRequest, "unknown_model"),
        ({"input": {"text": "word " * 2100}}, BatchyardError, "context_window_exceeded"),
    ],
)
async def test_prepare_refuses_a_bad_body_before_anything_moves(
    service, engine, change, error, code
):
    who = principal(service)
    with pytest.raises(error) as refused:
        await decisions.prepare(service, who.org_id, {**BODY, **change})
    assert refused.value.code == code
    assert engine.score_calls == []
    bal = balance(service, who.org_id)
    assert bal.held == 0 and bal.settled == 0


async def test_a_refused_admission_holds_and_calls_nothing(service, engine):
    who = principal(service)
    call = await decisions.prepare(service, who.org_id, BODY)
    admit = Admissions(service, who.org_id, refuse=RateLimited("over", retry_after=1.0))
    with pytest.raises(RateLimited):
        await decisions.decide(service, who, call, admit)
    assert engine.score_calls == []
    bal = balance(service, who.org_id)
    assert bal.held == 0 and bal.settled == 0


class Unreadable:
    """A generation route (it cannot score) whose model answers outside the outcomes."""

    name = "unreadable"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []

    async def complete(self, request: CompletionRequest) -> Completion:
        self.requests.append(request)
        return Completion(request.model, [Choice("sentiment: furious")], Usage(40, 3))

    async def aclose(self) -> None:
        return None


def with_catalog(
    make_service: ServiceFactory, models: list[ModelSpec], routes: list[RouteSpec]
) -> Service:
    base = default_catalog()
    catalog = Catalog([*base.models.values(), *models], [*base.routes.values(), *routes])
    return make_service(catalog=catalog)


async def test_an_unreadable_answer_releases_the_hold_and_charges_nothing(make_service):
    route = RouteSpec(
        id="fat",
        model="kettei-fat",
        engine="openai_http",
        upstream_model="fat-1",
        base_url="http://127.0.0.1:9/v1",
    )
    svc = with_catalog(make_service, [], [route])
    engine = Unreadable()
    svc.engines.set("fat", engine)
    who = principal(svc)
    call = await decisions.prepare(svc, who.org_id, {**BODY, "model": "kettei-fat"})
    assert not call.primary.scoring
    with pytest.raises(ModelOutputInvalid):
        await decisions.decide(svc, who, call, Admissions(svc, who.org_id))
    assert len(engine.requests) == 1
    bal = balance(svc, who.org_id)
    assert bal.held == 0 and bal.settled == 0


@pytest.fixture
def versioned(make_service: ServiceFactory) -> Service:
    """kettei-core plus a fine-tuned version on a route of its own."""
    version = ModelSpec(
        id=VERSION,
        input_per_mtok=Decimal("0.30"),
        output_per_mtok=Decimal("1.20"),
        context_window=2048,
        tokenizer="default",
        type="version",
        base_model="kettei-core",
        max_output_tokens=1024,
    )
    route = RouteSpec(
        id="acme-ft",
        model=VERSION,
        engine="openai_http",
        upstream_model="acme-ft-1",
        base_url="http://127.0.0.1:9/v1",
    )
    return with_catalog(make_service, [version], [route])


async def test_a_version_that_never_loads_in_time_releases_its_hold(versioned):
    slow = ScriptedEngine(clock=versioned.clock, delay_s=600)
    versioned.engines.set("acme-ft", slow)
    who = principal(versioned)
    body = {**BODY, "model": VERSION, "fallback": "none", "calibration": "none"}
    call = await decisions.prepare(versioned, who.org_id, body)
    assert call.fallback is None
    held: list[int] = []
    task = asyncio.create_task(
        decisions.decide(versioned, who, call, Admissions(versioned, who.org_id))
    )
    await until(lambda: slow.in_flight == 1)
    held.append(balance(versioned, who.org_id).held)
    versioned.clock.advance(decisions.LOAD_WAIT_BOUND_S)
    with pytest.raises(ModelWarming):
        await task
    assert held == [call.max_cost] and call.max_cost > 0
    assert balance(versioned, who.org_id).held == 0
    versioned.clock.advance(600)
    await until(lambda: slow.in_flight == 0)


async def test_the_hold_is_the_dearer_of_a_version_and_its_base(versioned):
    who = principal(versioned)
    call = await decisions.prepare(versioned, who.org_id, {**BODY, "model": VERSION})
    assert call.fallback is not None and call.fallback.model.id == "kettei-core"
    assert call.max_cost == max(call.primary.max_cost, call.fallback.max_cost)
    assert call.max_cost == call.primary.max_cost  # the version is the dearer here


@pytest.mark.parametrize(
    ("model", "minutes", "error", "code"),
    [
        (VERSION, 0, InvalidRequest, "minutes_out_of_range"),
        ("kettei-core", 10, InvalidRequest, "not_a_model_version"),
        ("kettei-nope", 10, NotFound, "not_found"),
    ],
)
async def test_keep_warm_refusals(versioned, model, minutes, error, code):
    who = principal(versioned)
    with pytest.raises(error) as refused:
        await decisions.prepare_keep_warm(versioned, who.org_id, model, minutes)
    assert refused.value.code == code


async def test_keep_warm_starts_the_load_and_says_until_when(versioned):
    slow = ScriptedEngine(clock=versioned.clock, delay_s=30)
    versioned.engines.set("acme-ft", slow)
    who = principal(versioned)
    target = await decisions.prepare_keep_warm(versioned, who.org_id, VERSION, 30)
    view = decisions.keep_warm(versioned, target)
    assert view["id"] == VERSION and view["warm"]["state"] == "loading"
    await until(lambda: slow.in_flight == 1)
    versioned.clock.advance(30)
    await until(lambda: slow.in_flight == 0)
    assert versioned.warmth.view(VERSION, target.serving).to_json()["state"] == "warm"
