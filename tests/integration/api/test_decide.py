"""POST /v1/decide over real HTTP: one text, every decision, paid once, as documented.

Engines are scripted on the service's ManualClock, so limits, the 24-hour
idempotency window and a version's slow load are driven by moving the clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import httpx
import pytest

from batchyard.core import decisions as rules
from batchyard.core.accounts import Scope
from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec, default_catalog
from batchyard.core.money import charge_ticks, format_money, to_ticks, token_cost
from batchyard.core.tiers import DEFAULT_TIERS
from batchyard.engines.protocol import Choice, Completion, CompletionRequest, Usage
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import ModelUnavailable
from batchyard.service import Service
from batchyard.store import accounts, activity, ledger
from batchyard.store import calibration as cal_store
from batchyard.work import decide_scoring
from batchyard.work.warmth import serving
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.server import asgi_client
from tests.support.services import ServiceFactory
from tests.support.waits import until

TEXT = "The battery died after two days."
SENTIMENT = {
    "id": "sentiment",
    "question": "How does the writer feel about the product?",
    "outcomes": [
        {"id": "positive", "description": "pleased"},
        {"id": "negative", "description": "unhappy"},
        {"id": "neutral", "description": "neither"},
    ],
}
TOPIC = {
    "id": "topic",
    "question": "What is the comment about?",
    "outcomes": [{"id": "battery"}, {"id": "screen"}, {"id": "price"}],
}
BODY: dict[str, Any] = {
    "model": "kettei-core",
    "input": {"text": TEXT},
    "decisions": [SENTIMENT, TOPIC],
    "max_output_tokens": 64,
}
CORE = (Decimal("0.10"), Decimal("0.40"))
VERSION = "kettei-core-acme"
VERSION_PRICE = (Decimal("0.30"), Decimal("1.20"))


def text_scorer(model: str, messages: list[dict[str, Any]], candidates: list[str]) -> list[float]:
    """Favour the outcome named in the text ("battery"; "died" reads as negative)."""
    prompt = str(messages[-1]["content"])
    text = prompt.split("Text:\n")[-1].lower().replace("died", "negative")
    scores = []
    for candidate in candidates:
        outcome = candidate.rsplit("\n", 1)[-1].split(": ", 1)[-1]
        scores.append(math.log(0.9) if outcome in text else math.log(0.05))
    return scores


def runs(engine: ScriptedEngine, body: dict[str, Any] = BODY) -> int:
    """How often the model answered ``body``'s text: one scoring call for every decision."""
    text = body["input"]["text"]
    return sum(text in str(c.messages) for c in engine.score_calls)


def words(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m["content"]).split()) for m in messages)


def cost(prices: tuple[Decimal, Decimal], usage: dict[str, int]) -> str:
    ticks = charge_ticks(token_cost(usage["input_tokens"], usage["output_tokens"], *prices))
    return format_money(ticks)


def balance(svc: Service, org_id: str) -> ledger.Balance:
    return svc.db.read_sync(lambda c: ledger.balance(c, org_id))


@pytest.fixture
def engine(service: Service) -> ScriptedEngine:
    eng = ScriptedEngine(clock=service.clock, scorer=text_scorer)
    service.engines.set("embedded", eng)
    return eng


@pytest.fixture
async def http(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(service) as client:
        yield client


# -- answers and billing -----------------------------------------------------------


async def test_every_decision_answered_in_one_call_with_the_text_paid_once(service, engine, http):
    acct = make_account(service, credit="1")
    r = await http.post("/v1/decide", json=BODY, headers=acct.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("dec.") and body["model"] == "kettei-core"
    assert body["fallback"] is None
    answers = {a["decision"]: a for a in body["answers"]}
    assert [a["decision"] for a in body["answers"]] == ["sentiment", "topic"]
    assert answers["sentiment"]["outcome"] == "negative"
    assert answers["topic"]["outcome"] == "battery"
    for answer in body["answers"]:
        probs = answer["probabilities"]
        assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-5)
        assert max(probs, key=probs.get) == answer["outcome"]
    # Calibration: first the set's content-free prior (three texts that say
    # nothing, one call each), then the text: one call, every outcome of every
    # decision, under the one prompt an uncalibrated call reads.
    calls = engine.score_calls
    assert len(calls) == 3 + 1
    content_free, real = calls[:3], calls[3:]
    assert all(TEXT not in str(c.messages) for c in content_free)
    listing = "- positive: pleased\n  - negative: unhappy\n  - neutral: neither"
    assert all(listing in c.messages[-1]["content"] for c in calls)
    listed = real[0].messages
    assert str(listed).count(TEXT) == 1
    # Each decision's answer line opens the reply on its own, whatever the
    # other decision answers: no call waits for another's answer.
    assert real[0].candidates == [
        "sentiment: positive",
        "sentiment: negative",
        "sentiment: neutral",
        "topic: battery",
        "topic: screen",
        "topic: price",
    ]
    # Each prompt is paid once however many decisions read it; calibration's are said apart.
    cf_prompts = {str(c.messages): words(c.messages) for c in content_free}
    assert len(cf_prompts) == 3
    extra = sum(cf_prompts.values())
    assert body["usage"]["input_tokens"] == words(listed) + extra
    assert body["usage"]["calibration_input_tokens"] == extra
    assert body["calibration"] == {
        "mode": "batch",
        "orders": 1,
        "texts": 0,
        "content_free_estimated": True,
    }
    for answer in body["answers"]:
        assert math.isclose(sum(answer["raw_probabilities"].values()), 1.0, abs_tol=1e-5)
    assert 0 < body["usage"]["output_tokens"] <= 64
    assert body["charge"] == cost(CORE, body["usage"])
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == to_ticks(Decimal(body["charge"]))
    acts = service.db.transact_sync(lambda c: activity.list_activity(c, acct.org_id))
    charge = next(a for a in acts if a["kind"] == "charge" and a["ref"] == body["id"])
    assert charge["detail"]["purpose"] == "decide" and charge["detail"]["decisions"] == 2
    assert charge["detail"]["calibration_input_tokens"] == extra
    # The next text of the set reads its one prompt only, as an uncalibrated
    # call does, and is calibrated by the first.
    service.clock.advance(2)
    again = (await http.post("/v1/decide", json=BODY, headers=acct.headers)).json()
    assert len(engine.score_calls) == 4 + 1
    assert again["usage"]["input_tokens"] == words(listed)
    assert again["usage"]["calibration_input_tokens"] == 0
    assert again["calibration"]["texts"] == 1
    assert again["calibration"]["content_free_estimated"] is False


async def test_a_read_key_cannot_decide(service, engine, http):
    acct = make_account(service, scope=Scope.READ)
    r = await http.post("/v1/decide", json=BODY, headers=acct.headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    inference = make_account(service, "acme", credit="0", scope=Scope.INFERENCE)
    ok = await http.post("/v1/decide", json=BODY, headers=inference.headers)
    assert ok.status_code == 200, ok.text


LONG_TEXT = "word " * 2100


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"decisions": []}, "no_decisions"),
        ({"decisions": [{**TOPIC, "outcomes": [{"id": "battery"}]}]}, "too_few_outcomes"),
        ({"decisions": [TOPIC, TOPIC]}, "duplicate_id"),
        ({"decisions": [{**TOPIC, "outcomes": [{"id": "a"}, {"id": "a"}]}]}, "duplicate_id"),
        ({"input": {"text": " "}}, "empty_text"),
        ({"input": {"text": LONG_TEXT}}, "context_window_exceeded"),
        ({"model": "kettei-nope"}, "unknown_model"),
        ({"input": {"image_url": "https://example.com/a.png"}}, "unsupported_input"),
        ({"max_output_tokens": 0}, "max_output_tokens_out_of_range"),
        ({"max_output_tokens": 100_000}, "max_output_tokens_out_of_range"),
        ({"max_output_tokens": 2}, "max_output_tokens_out_of_range"),
    ],
)
async def test_bad_input_is_400_with_its_code_and_leaves_the_key_free(
    service, engine, http, change, code
):
    acct = make_account(service, credit="1")
    headers = {**acct.headers, "Idempotency-Key": "item-1"}
    r = await http.post("/v1/decide", json={**BODY, **change}, headers=headers)
    assert r.status_code == (404 if code == "unknown_model" else 400), r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["retryable"] is False
    assert engine.score_calls == [] and balance(service, acct.org_id).settled == 0
    # Nothing was claimed under the key: the fixed body runs with it.
    fixed = await http.post("/v1/decide", json=BODY, headers=headers)
    assert fixed.status_code == 200, fixed.text
    assert fixed.headers.get("Idempotent-Replayed") is None


# -- idempotency ------------------------------------------------------------------


async def test_replay_returns_the_saved_answer_uncharged_for_24_hours(service, engine, http):
    acct = make_account(service, credit="1")
    headers = {**acct.headers, "Idempotency-Key": "ticket-1"}
    first = await http.post("/v1/decide", json=BODY, headers=headers)
    assert first.status_code == 200
    settled = balance(service, acct.org_id).settled
    service.clock.advance(23 * 3600)
    again = await http.post("/v1/decide", json=BODY, headers=headers)
    assert again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert runs(engine) == 1 and balance(service, acct.org_id).settled == settled
    changed = {**BODY, "decisions": [SENTIMENT]}
    conflict = await http.post("/v1/decide", json=changed, headers=headers)
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_conflict"
    service.clock.advance(3600 + 1)
    expired = await http.post("/v1/decide", json=BODY, headers=headers)
    assert expired.status_code == 409
    assert expired.json()["error"] == {
        **expired.json()["error"],
        "code": "idempotency_response_expired",
        "retryable": False,
    }
    assert runs(engine) == 1 and balance(service, acct.org_id).settled == settled


async def test_zero_data_retention_reruns_and_recharges(service, engine, http):
    acct = make_account(service, credit="1")
    service.db.transact_sync(lambda c: accounts.set_zero_data_retention(c, acct.org_id, True))
    headers = {**acct.headers, "Idempotency-Key": "ticket-1"}
    first = await http.post("/v1/decide", json=BODY, headers=headers)
    service.clock.advance(5)
    second = await http.post("/v1/decide", json=BODY, headers=headers)
    assert first.status_code == second.status_code == 200
    assert second.headers.get("Idempotent-Replayed") is None
    assert first.json()["id"] != second.json()["id"]
    assert runs(engine) == 2
    expected = to_ticks(Decimal(first.json()["charge"])) + to_ticks(
        Decimal(second.json()["charge"])
    )
    assert balance(service, acct.org_id).settled == expected
    # Nothing of its texts is kept, not even in the running mean: both saw none before.
    assert first.json()["calibration"]["texts"] == second.json()["calibration"]["texts"] == 0


# -- limits and credit ------------------------------------------------------------


async def test_over_the_tier_limit_is_429_with_retry_after_shared_by_every_key(make_service):
    service = make_service(limits_queue_s=0)
    engine = ScriptedEngine(clock=service.clock, scorer=text_scorer)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    other_key = make_account(service, "acme", credit="0", scope=Scope.INFERENCE)
    burst = service.tier(0).max_in_flight
    async with asgi_client(service) as http:
        for _ in range(burst):
            r = await http.post("/v1/decide", json=BODY, headers=acct.headers)
            assert r.status_code == 200
        limited = await http.post("/v1/decide", json=BODY, headers=other_key.headers)
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limited"
        assert limited.json()["error"]["retryable"] is True
        wait = int(limited.headers["Retry-After"])
        assert wait >= 1
        assert runs(engine) == burst
        service.clock.advance(wait)
        again = await http.post("/v1/decide", json=BODY, headers=other_key.headers)
        assert again.status_code == 200


async def test_402_when_credit_cannot_cover_the_most_expensive_outcome(service, engine, http):
    acct = make_account(service, credit="0")
    headers = {**acct.headers, "Idempotency-Key": "ticket-1"}
    r = await http.post("/v1/decide", json=BODY, headers=headers)
    assert r.status_code == 402
    err = r.json()["error"]
    assert err["code"] == "insufficient_credit" and err["retryable"] is True
    assert "nothing was charged" in err["message"]
    assert engine.score_calls == []
    bal = balance(service, acct.org_id)
    assert bal.settled == 0 and bal.held == 0


async def test_an_automatic_top_up_lets_the_call_through(service, engine, http):
    acct = make_account(service, credit="0")
    service.db.transact_sync(
        lambda c: accounts.set_auto_topup(c, acct.org_id, Decimal("1"), Decimal("5"))
    )
    r = await http.post("/v1/decide", json=BODY, headers=acct.headers)
    assert r.status_code == 200, r.text
    bal = balance(service, acct.org_id)
    assert bal.topups == to_ticks(Decimal("5"))
    assert bal.settled == to_ticks(Decimal(r.json()["charge"]))


# -- estimate ---------------------------------------------------------------------


async def test_estimate_counts_the_prompt_and_quotes_without_charging(service, engine, http):
    acct = make_account(service, credit="0", scope=Scope.INFERENCE)
    r = await http.post("/v1/decide/estimate", json=BODY, headers=acct.headers)
    assert r.status_code == 200, r.text
    est = r.json()
    from batchyard.core.decisions import build_messages, parse_request
    from batchyard.work.decide_scoring import content_free_requests

    model = service.catalog.model("kettei-core")
    count = service.tokenizer(model).count_messages
    req = parse_request(BODY)

    def listed(r: Any) -> int:
        return count(build_messages(r, "lines"))

    # The exact prompts decide would send: the text's and, since nothing of
    # this set is known yet, the content-free ones, which are what
    # calibration adds.
    content_free = sum(listed(r) for r in content_free_requests(req))
    assert est["input_tokens"] == listed(req) + content_free
    assert est["calibration_input_tokens"] == content_free
    assert est["content_free_input_tokens"] == content_free
    assert est["max_output_tokens"] == 64
    quote = token_cost(est["input_tokens"], 64, *CORE)
    assert Decimal(est["max_cost"]) >= quote
    assert Decimal(est["max_cost"]) - quote < Decimal("1e-10")
    assert engine.score_calls == [] and balance(service, acct.org_id).held == 0
    bad = await http.post(
        "/v1/decide/estimate", json={**BODY, "decisions": []}, headers=acct.headers
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "no_decisions"


async def test_estimates_have_their_own_token_budget(make_service):
    # A tier whose estimate budget is smaller than one estimate's tokens, and no
    # server-side queue: the second estimate in a row is refused at once.
    tier = dataclasses.replace(DEFAULT_TIERS[0], estimate_tokens_per_minute=600)
    service = make_service(tiers=(tier,), limits_queue_s=0)
    service.engines.set("embedded", ScriptedEngine(clock=service.clock, scorer=text_scorer))
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        # A decision spends the requests limit; an estimate right after still runs.
        assert (await http.post("/v1/decide", json=BODY, headers=acct.headers)).status_code == 200
        est = await http.post("/v1/decide/estimate", json=BODY, headers=acct.headers)
        assert est.status_code == 200
        # Its token headers are the estimate budget it spent from, not decide's tokens limit.
        assert est.headers["x-ratelimit-limit-tokens"] == "600"
        assert est.headers["x-ratelimit-remaining-tokens"] == "0"
        again = await http.post("/v1/decide/estimate", json=BODY, headers=acct.headers)
        assert again.status_code == 429 and "Retry-After" in again.headers
        assert again.headers["x-ratelimit-limit-tokens"] == "600"
        service.clock.advance(int(again.headers["Retry-After"]))
        assert (await http.post("/v1/decide/estimate", json=BODY, headers=acct.headers)).is_success


async def test_default_max_output_tokens_is_the_longest_answer(service, engine, http):
    acct = make_account(service, credit="1")
    body = {k: v for k, v in BODY.items() if k != "max_output_tokens"}
    est = (await http.post("/v1/decide/estimate", json=body, headers=acct.headers)).json()
    assert 4 <= est["max_output_tokens"] < 64
    r = await http.post("/v1/decide", json=body, headers=acct.headers)
    assert r.json()["usage"]["output_tokens"] <= est["max_output_tokens"]


# -- the newcomer's sequence -------------------------------------------------------


async def test_a_newcomers_sequence(service, engine, http):
    """estimate, decide, replay, change under the same key, run dry."""
    # Uncalibrated: the scripted engine counts words where the quote counts
    # bytes, which would leave the first call's content-free share unspent.
    body = {**BODY, "calibration": "none"}
    acct = make_account(service, "newcomer", credit="0")
    est = await http.post("/v1/decide/estimate", json=body, headers=acct.headers)
    assert est.status_code == 200
    max_cost = Decimal(est.json()["max_cost"])
    # Credit for exactly one call at its most expensive.
    service.db.transact_sync(
        lambda c: ledger.top_up(c, acct.org_id, to_ticks(max_cost), service.clock.now())
    )
    h1 = {**acct.headers, "Idempotency-Key": "ticket-1"}
    first = await http.post("/v1/decide", json=body, headers=h1)
    assert first.status_code == 200, first.text
    assert Decimal(first.json()["charge"]) <= max_cost
    replay = await http.post("/v1/decide", json=body, headers=h1)
    assert replay.status_code == 200 and replay.json() == first.json()
    changed = {**body, "decisions": [TOPIC]}
    conflict = await http.post("/v1/decide", json=changed, headers=h1)
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_conflict"
    h2 = {**acct.headers, "Idempotency-Key": "ticket-2"}
    broke = await http.post("/v1/decide", json=body, headers=h2)
    assert broke.status_code == 402
    assert broke.json()["error"]["code"] == "insufficient_credit"
    bal = balance(service, acct.org_id)
    assert bal.settled == to_ticks(Decimal(first.json()["charge"])) and bal.held == 0
    assert len(engine.score_calls) == 1


# -- OpenAI-compatible routes (generation, parsed strictly) -------------------------------


def with_catalog(
    make_service: ServiceFactory, models: list[ModelSpec], routes: list[RouteSpec]
) -> Service:
    """A migrated service whose catalog adds ``models`` and ``routes`` to the defaults."""
    base = default_catalog()
    catalog = Catalog([*base.models.values(), *models], [*base.routes.values(), *routes])
    return make_service(catalog=catalog)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    with FakeUpstream() as up:
        yield up


@pytest.fixture
def remote(make_service: ServiceFactory, upstream: FakeUpstream) -> Service:
    """kettei-chub on a JSON-schema route and kettei-fat on a free-text one, over HTTP."""
    routes = [
        RouteSpec(
            id="chub",
            model="kettei-chub",
            engine="openai_http",
            upstream_model="chub-1",
            base_url=upstream.base_url,
            supports_json_schema=True,
        ),
        RouteSpec(
            id="fat",
            model="kettei-fat",
            engine="openai_http",
            upstream_model="fat-1",
            base_url=upstream.base_url,
        ),
    ]
    return with_catalog(make_service, [], routes)


async def test_a_json_schema_route_gets_one_enum_per_decision(remote, upstream):
    acct = make_account(remote, credit="1")
    image = "data:image/png;base64,iVBORw0KGgo="
    body = {**BODY, "model": "kettei-chub", "input": {"text": TEXT, "image_url": image}}
    async with asgi_client(remote) as http:
        r = await http.post("/v1/decide", json=body, headers=acct.headers)
    assert r.status_code == 200, r.text
    sent = upstream.last_request
    assert sent is not None
    schema = sent["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["sentiment"]["enum"] == ["positive", "negative", "neutral"]
    assert sent["messages"][-1]["content"][1] == {"type": "image_url", "image_url": {"url": image}}
    assert sent["logprobs"] is True and sent["temperature"] == 0.0
    answers = r.json()["answers"]
    # FakeUpstream picks each enum's first value and sends no top_logprobs.
    assert answers == [
        {"decision": "sentiment", "outcome": "positive"},
        {"decision": "topic", "outcome": "battery"},
    ]
    prices = (Decimal("0.50"), Decimal("2.00"))
    assert r.json()["charge"] == cost(prices, r.json()["usage"])


async def test_unreadable_free_text_is_502_nothing_charged_and_saved(remote, upstream):
    acct = make_account(remote, credit="1")
    headers = {**acct.headers, "Idempotency-Key": "ticket-1"}
    body = {**BODY, "model": "kettei-fat"}
    async with asgi_client(remote) as http:
        r = await http.post("/v1/decide", json=body, headers=headers)
        again = await http.post("/v1/decide", json=body, headers=headers)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "model_output_invalid"
    assert r.json()["error"]["retryable"] is False
    assert again.status_code == 502 and again.headers["Idempotent-Replayed"] == "true"
    assert upstream.requests == 1
    bal = balance(remote, acct.org_id)
    assert bal.settled == 0 and bal.held == 0


class LogprobEngine:
    """An OpenAI-style engine that answers JSON with top_logprobs on the answer token."""

    name = "logprobs"

    def __init__(self) -> None:
        self.requests: list[CompletionRequest] = []

    async def complete(self, request: CompletionRequest) -> Completion:
        self.requests.append(request)
        top = {"negative": 0.7, "positive": 0.2, "neutral": 0.1}
        tokens = [
            {"token": '{"sentiment": "', "logprob": 0.0},
            {
                "token": "negative",
                "logprob": math.log(0.7),
                "top_logprobs": [{"token": t, "logprob": math.log(p)} for t, p in top.items()],
            },
            {"token": '"}', "logprob": 0.0},
        ]
        text = "".join(t["token"] for t in tokens)
        usage = Usage(40, 3, cached_input_tokens=32)  # the route read 32 from its cache
        return Completion(request.model, [Choice(text, logprobs=tokens)], usage)

    async def aclose(self) -> None:
        return None


async def test_probabilities_come_from_the_routes_top_logprobs(remote):
    engine = LogprobEngine()
    remote.engines.set("chub", engine)
    acct = make_account(remote, credit="1")
    body = {**BODY, "model": "kettei-chub", "decisions": [SENTIMENT]}
    async with asgi_client(remote) as http:
        r = await http.post("/v1/decide", json=body, headers=acct.headers)
    assert r.status_code == 200, r.text
    assert engine.requests[0].top_logprobs == 20
    assert r.json()["answers"] == [
        {
            "decision": "sentiment",
            "outcome": "negative",
            "probabilities": {"positive": 0.2, "negative": 0.7, "neutral": 0.1},
        }
    ]
    assert r.json()["usage"] == {
        "input_tokens": 40,
        "output_tokens": 3,
        "cached_input_tokens": 32,
        "calibration_input_tokens": 0,
    }
    # A generation route is not calibrated: its probabilities are the route's own.
    assert r.json()["calibration"] is None


# -- fine-tuned versions: cold until loaded, the 10-second fallback, keep-warm ----------

# Uncalibrated: these tests time a version's load by its scripted calls, and
# calibration's own calls are tested above.
ONE = {**BODY, "model": VERSION, "decisions": [SENTIMENT], "calibration": "none"}


@pytest.fixture
def versioned(make_service: ServiceFactory) -> Service:
    """kettei-core plus a fine-tuned version on its own route that loads in 30 s."""
    version = ModelSpec(
        id=VERSION,
        input_per_mtok=VERSION_PRICE[0],
        output_per_mtok=VERSION_PRICE[1],
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


@pytest.fixture
def engines(versioned: Service) -> tuple[ScriptedEngine, ScriptedEngine]:
    """(base, version): the version's engine takes 30 s of clock time per call."""
    base = ScriptedEngine(clock=versioned.clock, scorer=text_scorer)
    slow = ScriptedEngine(clock=versioned.clock, scorer=text_scorer, delay_s=30)
    versioned.engines.set("embedded", base)
    versioned.engines.set("acme-ft", slow)
    return base, slow


async def warm_state(http: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, Any]:
    r = await http.get(f"/v1/models/{VERSION}", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["warm"]


async def test_a_cold_version_falls_back_to_its_base_after_ten_seconds(versioned, engines):
    base, slow = engines
    clock = versioned.clock
    acct = make_account(versioned, credit="1")
    async with asgi_client(versioned) as http:
        assert (await warm_state(http, acct.headers))["state"] == "cold"
        listed = (await http.get("/v1/models", headers=acct.headers)).json()["data"]
        warm = {m["id"]: m["warm"] for m in listed}
        assert warm[VERSION]["state"] == "cold" and warm["kettei-core"] is None
        call = asyncio.create_task(http.post("/v1/decide", json=ONE, headers=acct.headers))
        await until(lambda: slow.in_flight == 1)
        clock.advance(9)
        await asyncio.sleep(0.05)
        assert not call.done()
        clock.advance(1)
        r = await call
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == VERSION
        assert body["fallback"] == {"reason": "model_warming", "model": "kettei-core"}
        assert body["answers"][0]["outcome"] == "negative"
        assert body["charge"] == cost(CORE, body["usage"])
        assert len(base.score_calls) == 1
        state = await warm_state(http, acct.headers)
        assert state == {"state": "loading", "until": None, "last_load_seconds": None}
        # The load goes on; once it ends the version is warm and says how long it took.
        clock.advance(20)
        await until(lambda: slow.in_flight == 0)
        state = await warm_state(http, acct.headers)
        assert state["state"] == "warm" and state["last_load_seconds"] == 30.0
        assert state["until"] is not None
        # Warm now: the version answers, at its own price.
        call = asyncio.create_task(http.post("/v1/decide", json=ONE, headers=acct.headers))
        await until(lambda: slow.in_flight == 1)
        clock.advance(30)
        r = await call
        assert r.status_code == 200, r.text
        assert r.json()["fallback"] is None
        assert r.json()["charge"] == cost(VERSION_PRICE, r.json()["usage"])
        assert len(base.score_calls) == 1 and len(slow.score_calls) == 2
        # Idle past the window, it goes cold again.
        clock.advance(16 * 60)
        assert (await warm_state(http, acct.headers))["state"] == "cold"
    bal = balance(versioned, acct.org_id)
    assert bal.held == 0


async def test_the_estimate_quotes_the_dearer_of_version_and_base(versioned, engines):
    acct = make_account(versioned, credit="1")
    async with asgi_client(versioned) as http:
        est = (await http.post("/v1/decide/estimate", json=ONE, headers=acct.headers)).json()
    quote = token_cost(est["input_tokens"], est["max_output_tokens"], *VERSION_PRICE)
    assert Decimal(est["max_cost"]) >= quote


async def test_fallback_none_waits_bounded_then_503_retryable_and_the_key_stays_free(
    versioned, engines
):
    base, slow = engines
    slow.delay_s = 120
    clock = versioned.clock
    acct = make_account(versioned, credit="1")
    headers = {**acct.headers, "Idempotency-Key": "ticket-1"}
    body = {**ONE, "fallback": "none"}
    async with asgi_client(versioned) as http:
        call = asyncio.create_task(http.post("/v1/decide", json=body, headers=headers))
        await until(lambda: slow.in_flight == 1)
        clock.advance(10)
        await asyncio.sleep(0.05)
        assert not call.done(), "fallback none does not fall back at 10 s"
        clock.advance(50)
        r = await call
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "model_warming" and err["retryable"] is True
        assert "Retry-After" in r.headers
        assert base.score_calls == []
        assert balance(versioned, acct.org_id).settled == 0
        clock.advance(60)
        await until(lambda: slow.in_flight == 0)
        assert (await warm_state(http, acct.headers))["state"] == "warm"
        again = asyncio.create_task(http.post("/v1/decide", json=body, headers=headers))
        await until(lambda: slow.in_flight == 1)
        clock.advance(120)
        r = await again
        assert r.status_code == 200, r.text
        assert r.json()["fallback"] is None
    bal = balance(versioned, acct.org_id)
    assert bal.settled == to_ticks(Decimal(r.json()["charge"])) and bal.held == 0


async def test_keep_warm_loads_a_version_and_holds_it_for_the_window(versioned, engines):
    _, slow = engines
    clock = versioned.clock
    acct = make_account(versioned, credit="1")
    start = clock.now()
    async with asgi_client(versioned) as http:
        r = await http.post(
            f"/v1/models/{VERSION}/keep-warm", json={"minutes": 30}, headers=acct.headers
        )
        assert r.status_code == 200, r.text
        assert r.json()["warm"]["state"] == "loading"
        assert r.json()["warm"]["until"] == isoformat_after(start, 1800)
        await until(lambda: slow.in_flight == 1)
        clock.advance(30)
        await until(lambda: slow.in_flight == 0)
        state = await warm_state(http, acct.headers)
        assert state["state"] == "warm" and state["last_load_seconds"] == 30.0
        # Idle for longer than the idle window, but inside the keep-warm window.
        clock.advance(20 * 60)
        assert (await warm_state(http, acct.headers))["state"] == "warm"
        call = asyncio.create_task(http.post("/v1/decide", json=ONE, headers=acct.headers))
        await until(lambda: slow.in_flight == 1)
        clock.advance(30)
        r = await call
        assert r.status_code == 200 and r.json()["fallback"] is None
        clock.advance(40 * 60)
        assert (await warm_state(http, acct.headers)) == {
            "state": "cold",
            "until": None,
            "last_load_seconds": 30.0,
        }
    # Keep-warm is not billed: only the decision was.
    assert balance(versioned, acct.org_id).settled == to_ticks(Decimal(r.json()["charge"]))


def isoformat_after(start: Any, seconds: float) -> str:
    from datetime import timedelta

    from batchyard.core.clock import isoformat

    return isoformat(start + timedelta(seconds=seconds))


@pytest.mark.parametrize(
    ("model", "body", "scope", "status", "code"),
    [
        (VERSION, {"minutes": 0}, Scope.FULL, 400, "minutes_out_of_range"),
        (VERSION, {"minutes": "ten"}, Scope.FULL, 400, "invalid_type"),
        (VERSION, {"minutes": 10}, Scope.READ, 403, "insufficient_scope"),
        ("kettei-core", {"minutes": 10}, Scope.FULL, 400, "not_a_model_version"),
        ("kettei-nope", {"minutes": 10}, Scope.FULL, 404, "not_found"),
    ],
)
async def test_keep_warm_refusals(versioned, engines, model, body, scope, status, code):
    acct = make_account(versioned, credit="0", scope=scope)
    async with asgi_client(versioned) as http:
        r = await http.post(f"/v1/models/{model}/keep-warm", json=body, headers=acct.headers)
    assert r.status_code == status and r.json()["error"]["code"] == code
    assert engines[1].score_calls == []


def test_a_version_can_be_served_by_its_base_route() -> None:
    """A route may list versions it serves (an adapter on the base) instead of its own route."""
    base = default_catalog()
    version = ModelSpec(
        id=VERSION,
        input_per_mtok=VERSION_PRICE[0],
        output_per_mtok=VERSION_PRICE[1],
        context_window=2048,
        type="version",
        base_model="kettei-core",
    )
    embedded = dataclasses.replace(
        base.routes["embedded"], version={VERSION: {"upstream_model": "acme-lora"}}
    )
    catalog = Catalog([*base.models.values(), version], [embedded])
    where = serving(catalog, catalog.model(VERSION))
    assert where.route.id == "embedded" and where.upstream_model == "acme-lora"
    assert serving(catalog, catalog.model("kettei-core")).upstream_model == embedded.upstream_model
    with pytest.raises(ModelUnavailable):
        serving(catalog, catalog.model("kettei-fat"))


async def test_the_running_mean_lives_in_memory_and_is_written_behind(
    service, engine, http, monkeypatch
):

    acct = make_account(service, credit="1")
    first = await http.post("/v1/decide", json=BODY, headers=acct.headers)
    assert first.json()["calibration"]["content_free_estimated"] is True
    await service.calibrations.flush()
    # From here on a call neither reads nor writes calibration state: the
    # background writer is held back, and every read of the store is counted.
    with monkeypatch.context() as m:
        m.setattr(service.calibrations, "_persist_soon", lambda: None)
        reads: list[str] = []
        load = cal_store.load_state

        def counted(*args: Any) -> Any:
            reads.append(args[2])
            return load(*args)

        m.setattr(cal_store, "load_state", counted)
        seen = []
        for _ in range(4):
            service.clock.advance(2)  # under the tier's request rate
            body = (await http.post("/v1/decide", json=BODY, headers=acct.headers)).json()
            seen.append(body["calibration"]["texts"])
        assert reads == []
    # Each text is calibrated by every text before it, at once (the memory's sums).
    assert seen == [1, 2, 3, 4]
    req = rules.parse_request(BODY)
    fingerprint = decide_scoring.fingerprint("kettei-core", req)
    stored = service.db.read_sync(lambda c: cal_store.load_state(c, acct.org_id, fingerprint))
    assert stored is not None and stored.texts == [1, 1]
    # Written behind, in one write: the store then holds every text.
    await service.calibrations.flush()
    stored = service.db.read_sync(lambda c: cal_store.load_state(c, acct.org_id, fingerprint))
    assert stored is not None and stored.texts == [5, 5]
    # Another process's texts arrive with the next write (the store's sums are read back).
    service.db.transact_sync(
        lambda c: cal_store.add_texts(c, acct.org_id, fingerprint, stored.prob_sums, texts=5)
    )
    service.clock.advance(2)
    await http.post("/v1/decide", json=BODY, headers=acct.headers)
    await service.calibrations.flush()
    service.clock.advance(2)
    after = (await http.post("/v1/decide", json=BODY, headers=acct.headers)).json()
    assert after["calibration"]["texts"] == 11
    # A process that starts now reads the shared state once.
    other = decide_scoring.Calibrations(service.dispatcher)
    assert await other.prior_known(acct.org_id, "kettei-core", req)
    await service.calibrations.flush()
    assert other._running[(acct.org_id, fingerprint)].texts == [12, 12]
