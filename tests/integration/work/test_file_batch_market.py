"""A file batch with a window longer than 24 h waits for a price on the deferred batches' market."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest

from batchyard.app import stuck_watch
from batchyard.core.money import from_ticks
from batchyard.engines.scripted import ScriptedEngine
from batchyard.store import stuck
from tests.support.accounts import make_account
from tests.support.deferred_batches import feed_route, set_price
from tests.support.file_batches import chat_line, create, jsonl, lines_of, upload, worker
from tests.support.server import asgi_client

HIGH = ("0.2", "0.8")  # twice kettei-core's direct 0.10 / 0.40: no route qualifies
HALF = ("0.05", "0.2")  # 50 % off
CHEAP = ("0.008", "0.03")  # 92 % off


def _direct(line) -> Decimal:
    return Decimal("0.10") * line.usage_input / 10**6 + Decimal("0.40") * line.usage_output / 10**6


async def _batch(http, acct, window: str, n: int = 3, **extra):
    f = (await upload(http, acct.headers, jsonl([chat_line(f"r{i}") for i in range(n)]))).json()
    made = await create(http, acct.headers, f["id"], window=window, **extra)
    assert made.status_code == 200, made.text
    return made.json()


async def _show(http, acct, batch_id: str):
    return (await http.get(f"/v1/batches/{batch_id}", headers=acct.headers)).json()


async def test_a_72h_batch_waits_for_a_dip_and_pays_less_than_at_24h(market, clock):
    svc = market(feed_route("spot"))
    svc.engines.set("spot", ScriptedEngine("done", clock=clock))
    acct = make_account(svc, credit="1")
    w = worker(svc)
    async with asgi_client(svc, worker=False) as http:
        set_price(svc, "spot", *HIGH)
        day = await _batch(http, acct, "24h")
        long = await _batch(http, acct, "72h")
        assert long["completion_window"] == "72h"
        assert long["expires_at"] - long["created_at"] == 72 * 3600
        await w.run_until_idle()
        assert (await _show(http, acct, day["id"]))["status"] == "completed"
        waiting = await _show(http, acct, long["id"])
        assert waiting["status"] == "in_progress" and waiting["request_counts"]["waiting"] == 3
        for _ in range(6):  # a day of high prices, the market refreshed every 4 hours
            clock.advance(4 * 3600)
            set_price(svc, "spot", *HIGH)
            await w.run_until_idle()
        assert (await _show(http, acct, long["id"]))["request_counts"]["waiting"] == 3
        clock.advance(3600)
        set_price(svc, "spot", *CHEAP)  # the dip
        await w.run_until_idle()
        done = await _show(http, acct, long["id"])
        shown_day = await _show(http, acct, day["id"])
    assert done["status"] == "completed" and done["completed_at"] < done["expires_at"]
    paid_day = sum(from_ticks(ln.charge) for ln in lines_of(svc, day["id"]))
    paid_long = sum(from_ticks(ln.charge) for ln in lines_of(svc, long["id"]))
    assert Decimal(0) < paid_long < paid_day
    # The batch object says what its lines paid against the direct price they were quoted at.
    assert Decimal(done["charge"]) == paid_long
    assert Decimal(done["direct_charge"]) == Decimal(shown_day["direct_charge"]) == paid_day
    assert Decimal(done["saved"]) == paid_day - paid_long > 0
    assert Decimal(shown_day["saved"]) == 0
    for line in lines_of(svc, long["id"]):
        assert line.route == "spot" and from_ticks(line.charge) < _direct(line)
    for line in lines_of(svc, day["id"]):  # 24 h: at once, at the direct price, as today
        assert from_ticks(line.charge) == pytest.approx(_direct(line), abs=Decimal("0.000001"))


async def test_a_72h_batch_on_a_market_that_never_dips_meets_its_deadline(market, clock):
    svc = market(feed_route("spot"), market_policy="deadline_aware")
    svc.engines.set("spot", ScriptedEngine("done", clock=clock))
    acct = make_account(svc, credit="1")
    w = worker(svc)
    async with asgi_client(svc, worker=False) as http:
        long = await _batch(http, acct, "72h")
        for _ in range(11):  # 44 h of prices above the direct one
            set_price(svc, "spot", *HIGH)
            await w.run_until_idle()
            clock.advance(4 * 3600)
        assert (await _show(http, acct, long["id"]))["request_counts"]["waiting"] == 3
        # Seen as waiting for a price, not stuck for no reason.
        (idle,) = svc.db.read_sync(lambda c: stuck.idle_work(c, clock.now()))
        why = stuck_watch(svc).why(idle, clock.now())
        assert idle.id == long["id"] and why.reason == "market" and "wait for a price" in why.detail
        clock.advance(4 * 3600 + 1)  # 24 h are left: the lines go as a 24 h batch's do
        set_price(svc, "spot", *HIGH)
        await w.run_until_idle()
        done = await _show(http, acct, long["id"])
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 3
    assert done["completed_at"] <= done["expires_at"] - 24 * 3600 + 60
    for line in lines_of(svc, long["id"]):  # never more than the direct price it was quoted at
        assert from_ticks(line.charge) == pytest.approx(_direct(line), abs=Decimal("0.000001"))


async def test_a_72h_batch_with_a_min_discount_waits_for_it_on_the_market(market, clock):
    svc = market(feed_route("spot"))
    svc.engines.set("spot", ScriptedEngine("done", clock=clock))
    acct = make_account(svc, credit="1")
    w = worker(svc)
    async with asgi_client(svc, worker=False) as http:
        set_price(svc, "spot", *HALF)
        long = await _batch(http, acct, "72h", metadata={"min_discount": "90"})
        await w.run_until_idle()
        assert (await _show(http, acct, long["id"]))["request_counts"]["waiting"] == 3
        clock.advance(timedelta(hours=30).total_seconds())
        set_price(svc, "spot", *CHEAP)
        await w.run_until_idle()
        done = await _show(http, acct, long["id"])
    assert done["status"] == "completed"
    assert all(ln.route == "spot" for ln in lines_of(svc, long["id"]))


@pytest.mark.parametrize("window", ["12h", "25h", "7d", 72])
async def test_a_window_batchyard_does_not_offer_is_a_coded_400_listing_them(service, window):
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        r = await create(http, acct.headers, f["id"], window=window)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_completion_window" and err["param"] == "completion_window"
    assert all(w in err["message"] for w in ("24h", "48h", "72h", "168h"))
