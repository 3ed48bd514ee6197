"""Spend caps over HTTP: set on a key or a project, enforced by every door's hold, shown.

The ledger's own tests (``tests/integration/store/test_spend_caps.py``) race
holds directly; here the doors do: 50 chat calls at once on one key capped at
exactly ten calls' worth (on PostgreSQL, where the holds really run side by
side) hold ten and refuse forty; a file batch whose quote would cross its
key's cap fails at creation holding nothing; decide counts against the key
too; ``/v1/account`` shows spend against each cap.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from sqlalchemy import func, select

from batchyard.core.accounts import Scope
from batchyard.core.money import format_money, from_ticks, parse_money, to_ticks
from batchyard.store import ledger
from batchyard.store.tables import reservations
from tests.support.accounts import add_key, make_account
from tests.support.deferred_batches import BlockingEngine, eventually
from tests.support.file_batches import chat_line, create, jsonl, upload
from tests.support.server import asgi_client
from tests.support.workspace import answer_with

CHAT = {
    "model": "kettei-core",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 8,
}


def _last_hold(service) -> int:  # type: ignore[no-untyped-def]
    """The amount of the newest reservation: what the last call held (its quote)."""
    return int(
        service.db.read_sync(
            lambda c: c.execute(
                select(reservations.c.amount).order_by(reservations.c.created_at.desc()).limit(1)
            ).scalar_one()
        )
    )


def _held_now(service) -> int:  # type: ignore[no-untyped-def]
    return int(
        service.db.read_sync(
            lambda c: c.execute(
                select(func.count()).where(reservations.c.state == "held")
            ).scalar_one()
        )
    )


@pytest.mark.postgres
async def test_fifty_calls_at_once_against_a_cap_of_exactly_ten_hold_ten(make_service):
    service = make_service(postgres=True)
    engine = BlockingEngine("hi")
    service.engines.set("embedded", engine)
    # Tier 3: its concurrency (100) and request rate let all fifty reach the hold at once.
    acct = make_account(service, credit="100", tier=3)
    probe = add_key(service, "acme", Scope.FULL)
    async with asgi_client(service, worker=False) as http:
        # What one call holds (its quote), measured on another key of the organisation.
        first = asyncio.create_task(
            http.post("/v1/chat/completions", json=CHAT, headers=probe.headers)
        )
        await eventually(lambda: _held_now(service) == 1)
        quote = _last_hold(service)
        engine.release.set()
        assert (await first).status_code == 200
        engine.release.clear()
        cap = 10 * quote
        r = await http.put(
            f"/v1/keys/{acct.key_id}/spend-cap",
            json={"total": format_money(from_ticks(cap))},
            headers=acct.headers,
        )
        assert r.status_code == 200, r.text
        calls = [
            asyncio.create_task(http.post("/v1/chat/completions", json=CHAT, headers=acct.headers))
            for _ in range(50)
        ]
        try:
            # Nothing settles while the engine is held: every call holds or is refused first.
            await eventually(lambda: sum(t.done() for t in calls) == 40)
            assert _held_now(service) == 10
        finally:
            engine.release.set()  # a failure above must not leave calls waiting forever
        answers = await asyncio.gather(*calls)
        account = (await http.get("/v1/account", headers=acct.headers)).json()
    codes = Counter(a.status_code for a in answers)
    assert codes == Counter({200: 10, 402: 40})
    refused = {a.json()["error"]["code"] for a in answers if a.status_code == 402}
    assert refused == {"spend_cap_exceeded"}
    (shown,) = account["spend_caps"]
    charged = to_ticks(parse_money(shown["total"]["charged"]))
    assert shown["holder"] == "key" and shown["id"] == acct.key_id
    assert shown["total"]["held"] == "0" and 0 < charged <= cap
    charges = [to_ticks(parse_money(a.json()["charge"])) for a in answers if a.status_code == 200]
    assert charged == sum(charges)


async def test_a_file_batch_over_its_key_s_cap_fails_holding_nothing(service):
    answer_with(service)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        capped = await http.put(
            f"/v1/keys/{acct.key_id}/spend-cap",
            json={"total": None, "monthly": "0.0000001"},
            headers=acct.headers,
        )
        f = (await upload(http, acct.headers, jsonl([chat_line("a"), chat_line("b")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
    assert capped.status_code == 200 and capped.json()["monthly"]["cap"] == "0.0000001"
    assert batch["status"] == "failed"
    (error,) = batch["errors"]["data"]
    assert error["code"] == "spend_cap_exceeded" and "monthly" in error["message"]
    assert service.db.read_sync(lambda c: ledger.balance(c, acct.org_id)).held == 0


async def test_decide_counts_against_the_key_and_is_refused_over_it(service):
    answer_with(service)
    acct = make_account(service, credit="1")
    body = {
        "model": "kettei-core",
        "input": {"text": "The parcel came two weeks late."},
        "decisions": [
            {
                "id": "mood",
                "question": "How does the writer feel?",
                "outcomes": [{"id": "happy"}, {"id": "unhappy"}],
            }
        ],
    }
    async with asgi_client(service, worker=False) as http:
        await http.put(
            f"/v1/keys/{acct.key_id}/spend-cap", json={"total": "0"}, headers=acct.headers
        )
        r = await http.post("/v1/decide", json=body, headers=acct.headers)
    assert r.status_code == 402 and r.json()["error"]["code"] == "spend_cap_exceeded"
    assert r.json()["error"]["retryable"] is False


async def test_who_may_set_a_cap_and_what_a_bad_one_is(service):
    acct = make_account(service, credit="1")
    inference = add_key(service, "acme", Scope.INFERENCE)
    other = make_account(service, "globex", credit="1")
    async with asgi_client(service, worker=False) as http:
        path = f"/v1/keys/{inference.key_id}/spend-cap"
        by_inference = await http.put(path, json={"total": "1"}, headers=inference.headers)
        by_other = await http.put(path, json={"total": "1"}, headers=other.headers)
        negative = await http.put(path, json={"total": "-1"}, headers=acct.headers)
        unknown = await http.put(path, json={"yearly": "1"}, headers=acct.headers)
        ok = await http.put(path, json={"total": "1", "monthly": 0.5}, headers=acct.headers)
        gone = await http.put(path, json={"total": None, "monthly": None}, headers=acct.headers)
        project = (await http.post("/v1/projects", json={"name": "p"}, headers=acct.headers)).json()
        by_project = await http.put(
            f"/v1/projects/{project['id']}/spend-cap", json={"monthly": "2"}, headers=acct.headers
        )
        account = (await http.get("/v1/account", headers=acct.headers)).json()
    assert by_inference.status_code == 403
    assert by_other.status_code == 404
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "total"
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "yearly"
    assert ok.status_code == 200 and ok.json()["total"]["cap"] == "1"
    assert ok.json()["monthly"]["cap"] == "0.5"
    assert gone.json() == {"object": "spend_cap", "removed": True}
    assert by_project.status_code == 200 and by_project.json()["holder"] == "project"
    assert [(c["holder"], c["id"]) for c in account["spend_caps"]] == [("project", project["id"])]
