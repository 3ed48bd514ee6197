"""Decide on the real embedded SmolLM2 (route ``embedded``): per-outcome scoring end to end."""

from __future__ import annotations

import math

import pytest

from batchyard.store import ledger
from tests.support.accounts import make_account
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
    async with asgi_client(service, timeout=120) as http:
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
