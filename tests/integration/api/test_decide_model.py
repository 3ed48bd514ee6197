"""Decide on the real embedded SmolLM2 (route ``embedded``): per-outcome scoring end to end."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest

from batchyard.core.money import charge_ticks, format_money
from batchyard.core.prices import Price
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.cached_routes import CACHED_PER_MTOK, cached_catalog
from tests.support.server import asgi_client

pytestmark = pytest.mark.model

BODY = {
    "model": "kettei-core",
    "input": {"text": "I love this phone. The screen is bright and sharp."},
    "decisions": [
        {
            "id": "sentiment",
            "question": "How does the writer feel?",
            "outcomes": [
                {"id": "positive", "description": "pleased"},
                {"id": "negative", "description": "unhappy"},
            ],
        },
        {
            "id": "topic",
            "question": "What is it about?",
            "outcomes": [{"id": "screen"}, {"id": "battery"}, {"id": "price"}],
        },
    ],
    "max_output_tokens": 32,
}


async def test_decide_on_the_embedded_model(service) -> None:
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        est = await http.post("/v1/decide/estimate", json=BODY, headers=acct.headers)
        assert est.status_code == 200, est.text
        service.clock.advance(2)
        r = await http.post("/v1/decide", json=BODY, headers=acct.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    for decision, answer in zip(BODY["decisions"], body["answers"], strict=True):
        ids = [o["id"] for o in decision["outcomes"]]
        assert answer["decision"] == decision["id"]
        assert answer["outcome"] in ids
        probs = answer["probabilities"]
        assert list(probs) == ids
        assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-4)
        assert all(0.0 <= p <= 1.0 for p in probs.values())
        assert max(probs, key=probs.get) == answer["outcome"]
    # The estimate counted exactly the prompt the model read, and it was paid once.
    assert body["usage"]["input_tokens"] == est.json()["input_tokens"]
    assert 0 < body["usage"]["output_tokens"] <= 32
    assert 0 < float(body["charge"]) <= float(est.json()["max_cost"])
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled > 0


SENTIMENT = {
    "id": "sentiment",
    "question": "How does the writer feel?",
    "outcomes": [
        {"id": "positive", "description": "pleased"},
        {"id": "negative", "description": "unhappy"},
        {"id": "neutral", "description": "neither"},
    ],
}


def _body(text: str, **extra: object) -> dict[str, object]:
    return {"model": "kettei-core", "input": {"text": text}, "decisions": [SENTIMENT], **extra}


async def test_calibrated_answers_carry_the_raw_ones_and_pay_for_the_content_free_prompts(
    service,
) -> None:

    from batchyard.core.money import charge_ticks, format_money, token_cost

    acct = make_account(service, credit="1")
    model = service.catalog.model("kettei-core")
    prices = (model.input_per_mtok, model.output_per_mtok)
    texts = ["I love it, best purchase all year!", "Broken on arrival. Awful.", "It is blue."]
    async with asgi_client(service) as http:
        est = (
            await http.post("/v1/decide/estimate", json=_body(texts[0]), headers=acct.headers)
        ).json()
        bodies = []
        for text in texts:
            service.clock.advance(2)
            raw = await http.post(
                "/v1/decide", json=_body(text, calibration="none"), headers=acct.headers
            )
            service.clock.advance(2)
            r = await http.post("/v1/decide", json=_body(text), headers=acct.headers)
            assert r.status_code == 200 and raw.status_code == 200, r.text
            bodies.append((raw.json(), r.json()))
        service.clock.advance(2)
        est_after = (
            await http.post("/v1/decide/estimate", json=_body(texts[0]), headers=acct.headers)
        ).json()
    prompt = bodies[0][0]["usage"]["input_tokens"]
    for n, (uncalibrated, calibrated) in enumerate(bodies):
        # calibration "none": the model's own softmax, one prompt, as before.
        assert uncalibrated["calibration"] is None
        assert "raw_probabilities" not in uncalibrated["answers"][0]
        assert uncalibrated["usage"]["calibration_input_tokens"] == 0
        answer = calibrated["answers"][0]
        probs, raw = answer["probabilities"], answer["raw_probabilities"]
        assert list(probs) == list(raw) == ["positive", "negative", "neutral"]
        assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-4)
        assert math.isclose(sum(raw.values()), 1.0, abs_tol=1e-4)
        assert answer["outcome"] == max(probs, key=probs.get)
        assert probs != raw
        info = calibrated["calibration"]
        assert info["mode"] == "batch" and info["orders"] == 1
        # Only the texts before this one inform its prior.
        assert info["texts"] == n
        usage = calibrated["usage"]
        assert calibrated["charge"] == format_money(
            charge_ticks(token_cost(usage["input_tokens"], usage["output_tokens"], *prices))
        )
        # The call reads the one prompt the uncalibrated call reads, plus,
        # the first time, the content-free prompts.
        own = usage["input_tokens"] - usage["calibration_input_tokens"]
        assert own == uncalibrated["usage"]["input_tokens"]
        assert (usage["calibration_input_tokens"] > 0) == (n == 0)
    first, second = bodies[0][1], bodies[1][1]
    # The first call also estimated the set's content-free prior, and paid for
    # it: three prompts that say nothing.
    assert first["calibration"]["content_free_estimated"] is True
    assert second["calibration"]["content_free_estimated"] is False
    assert first["usage"]["calibration_input_tokens"] > 2 * prompt
    assert second["charge"] == bodies[1][0]["charge"]
    # The estimate quoted the content-free prompts before, and none after.
    assert est["input_tokens"] == first["usage"]["input_tokens"]
    assert est["calibration_input_tokens"] == first["usage"]["calibration_input_tokens"]
    assert est_after["input_tokens"] == prompt and est_after["calibration_input_tokens"] == 0
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0


async def test_a_sets_questions_are_read_from_the_cache_and_charged_at_the_cached_price(
    make_service,
) -> None:
    """The second text of a set finds the set's questions in the engine's prompt cache."""
    service = make_service(catalog=cached_catalog())
    model = service.catalog.model("kettei-core")
    price = Price(model.input_per_mtok, model.output_per_mtok, CACHED_PER_MTOK)
    acct = make_account(service, credit="1")
    texts = ["The lid cracked the first week.", "Fast delivery and it works great."]
    answers = []
    async with asgi_client(service) as http:
        for text in texts:
            service.clock.advance(2)
            r = await http.post(
                "/v1/decide", json=_body(text, calibration="none"), headers=acct.headers
            )
            assert r.status_code == 200, r.text
            answers.append(r.json())
    first, second = (a["usage"] for a in answers)
    # The second text shares everything before its own text with the first.
    assert 0 <= first["cached_input_tokens"] < second["cached_input_tokens"]
    assert second["cached_input_tokens"] < second["input_tokens"]
    for body in answers:
        usage = body["usage"]
        settled = price.cost(
            usage["input_tokens"], usage["output_tokens"], usage["cached_input_tokens"]
        )
        assert body["charge"] == format_money(charge_ticks(settled))
    uncached = price.cost(second["input_tokens"], second["output_tokens"])
    assert charge_ticks(uncached) > charge_ticks(
        price.cost(second["input_tokens"], second["output_tokens"], second["cached_input_tokens"])
    )
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0
    assert bal.settled == sum(charge_ticks(Decimal(a["charge"])) for a in answers)
