"""The deferred-batch worker walks every item state, on a scripted market and a manual clock."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal

import pytest

from batchyard.app import deferred_batch_worker
from batchyard.core.market import DeadlineAware, FirstEligible, RouteOffer
from batchyard.core.prices import Price
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import UpstreamError
from batchyard.store import accounts, ledger
from batchyard.store.activity import list_activity
from tests.support.accounts import make_account
from tests.support.deferred_batches import (
    BlockingEngine,
    all_items,
    batch_body,
    catalog,
    eventually_ticking,
    feed_route,
    fixed_route,
    item_rows,
    set_price,
    submit,
    worker,
)
from tests.support.server import asgi_client
from tests.support.waits import settles

# kettei-core direct: 0.10 / 0.40 per Mtok. 90 % off needs <= 0.01 / 0.04.
CHEAP = ("0.008", "0.03")  # 92 % / 92.5 %
HALF = ("0.05", "0.2")  # 50 %


async def _submit(svc, acct, body):
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def statuses(svc, bid):
    return [i.status for i in item_rows(svc, bid)]


def balance(svc, acct):
    return svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))


async def test_waits_without_holding_funds_then_dispatches_when_a_price_qualifies(market, clock):
    svc = market(feed_route("spot"))
    engine = ScriptedEngine("two words", clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc, credit="1")
    bid = await _submit(svc, acct, batch_body(2))

    assert (await worker(svc).run_pass()).dispatched == 0  # no price at all
    set_price(svc, "spot", *HALF)
    assert (await worker(svc).run_pass()).dispatched == 0  # 50 % < 90 %
    set_price(svc, "spot", "0.008", "0.05")  # input qualifies, output does not
    assert (await worker(svc).run_pass()).dispatched == 0
    assert statuses(svc, bid) == ["waiting", "waiting"]
    assert balance(svc, acct).held == 0 and engine.calls == []

    set_price(svc, "spot", *CHEAP)
    report = await worker(svc).run_pass()
    assert (report.dispatched, report.succeeded) == (2, 2)
    assert statuses(svc, bid) == ["succeeded", "succeeded"]
    assert engine.calls[0].model == "spot-upstream"
    bal = balance(svc, acct)
    assert bal.held == 0
    # Each call: prompt words at 0.008, two output words at 0.03 per Mtok.
    words = len(["Summarize", "this", "public", "release", "note."])
    per_call = (Decimal(words) * Decimal("0.008") + 2 * Decimal("0.03")) / Decimal(10**6)
    assert bal.settled == int(2 * per_call * 10**10)


async def test_a_stale_price_cannot_authorise_a_spend(market, clock):
    svc = market(feed_route("spot"), price_max_age_s=300.0)
    svc.engines.set("spot", ScriptedEngine("x", clock=clock))
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    clock.advance(301)
    assert (await worker(svc).run_pass()).dispatched == 0
    assert statuses(svc, bid) == ["waiting"]


async def test_routes_without_hard_caps_or_with_a_bad_fallback_never_qualify(market, clock):
    svc = market(
        feed_route("nocaps", caps=False),
        feed_route("capped", fallbacks=["dear"]),
        feed_route("dear"),
    )
    engines = {r: ScriptedEngine("x", clock=clock) for r in ("nocaps", "capped", "dear")}
    for r, e in engines.items():
        svc.engines.set(r, e)
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "nocaps", "0", "0")
    set_price(svc, "capped", *CHEAP)
    set_price(svc, "dear", *HALF)  # the fallback capped could switch to
    assert (await worker(svc).run_pass()).dispatched == 0
    set_price(svc, "dear", "0.009", "0.036")  # now every fallback qualifies too
    assert (await worker(svc).run_pass()).succeeded == 1
    assert statuses(svc, bid) == ["succeeded"]
    assert len(engines["capped"].calls) == 1 and not engines["nocaps"].calls


async def test_per_request_min_discount_raises_the_bar(market, clock):
    svc = market(feed_route("spot"))
    svc.engines.set("spot", ScriptedEngine("x", clock=clock))
    acct = make_account(svc)
    body = batch_body(2)
    body["requests"][1]["min_discount"] = 95
    bid = await _submit(svc, acct, body)
    set_price(svc, "spot", *CHEAP)  # 92 %: enough for 90, not for 95
    await worker(svc).run_pass()
    assert statuses(svc, bid) == ["succeeded", "waiting"]


async def test_items_expire_when_no_qualifying_price_appears(market, clock):
    svc = market(feed_route("spot"))
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(2, completion_window="1h"))
    set_price(svc, "spot", *HALF)
    clock.advance(3599)
    await worker(svc).run_pass()
    assert statuses(svc, bid) == ["waiting", "waiting"]
    clock.advance(1)
    set_price(svc, "spot", *CHEAP)  # too late: the deadline has come
    report = await worker(svc).run_pass()
    assert report.expired == 2 and report.dispatched == 0
    assert statuses(svc, bid) == ["expired", "expired"]
    async with asgi_client(svc, worker=False) as http:
        b = (await http.get(f"/v1/batches/{bid}", headers=acct.headers)).json()
        lines = (await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)).content
    assert b["status"] == "expired" and b["completed_at"] is not None
    assert [json.loads(x)["result"] for x in lines.splitlines()] == [None, None]
    assert balance(svc, acct).held == 0


async def test_revoking_the_submitting_key_cancels_undispatched_items(market, clock):
    svc = market(feed_route("spot"))
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(2))
    svc.db.transact_sync(lambda c: accounts.revoke_key(c, acct.key_id, clock.now()))
    set_price(svc, "spot", *CHEAP)
    report = await worker(svc).run_pass()
    assert report.canceled == 2 and engine.calls == []
    assert [(i.status, i.reason) for i in item_rows(svc, bid)] == [("canceled", "key_revoked")] * 2


class RevokeWhileChoosing:
    """A policy that revokes the key mid-pass: the claim's own recheck must catch it."""

    name = "revoking"

    def __init__(self, svc, key_id):
        self.svc, self.key_id, self.inner = svc, key_id, FirstEligible()

    def choose(self, item, offers, direct, now):
        self.svc.db.transact_sync(lambda c: accounts.revoke_key(c, self.key_id, now))
        return self.inner.choose(item, offers, direct, now)


async def test_the_key_is_rechecked_just_before_dispatch(market, clock):
    svc = market(feed_route("spot"))
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    w = deferred_batch_worker(
        svc, policy=RevokeWhileChoosing(svc, acct.key_id), book=worker(svc).book
    )
    report = await w.run_pass()
    assert report.dispatched == 0 and report.canceled == 1 and engine.calls == []
    assert statuses(svc, bid) == ["canceled"]
    assert balance(svc, acct).held == 0


async def test_a_dispatched_failure_is_released_recorded_and_never_retried(market, clock):
    svc = market(feed_route("spot"))
    engine = ScriptedEngine("x", clock=clock, failures=[UpstreamError("upstream broke")])
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    report = await worker(svc).run_pass()
    assert (report.dispatched, report.failed) == (1, 1)
    for _ in range(3):
        clock.advance(15)
        await worker(svc).run_pass()
    assert len(engine.calls) == 1
    (item,) = item_rows(svc, bid)
    assert (item.status, item.reason, item.result_status) == ("failed", "upstream_error", 502)
    res = svc.db.transact_sync(lambda c: ledger.get_reservation(c, item.reservation_id))
    assert res.state == "released" and res.charged == 0
    async with asgi_client(svc, worker=False) as http:
        (line,) = (
            await http.get(f"/v1/batches/{bid}/results", headers=acct.headers)
        ).content.splitlines()
    line = json.loads(line)
    assert line["status"] == "failed" and line["reservation_id"] == item.reservation_id
    assert line["result"]["status_code"] == 502
    assert line["result"]["body"]["error"]["code"] == "upstream_error"


async def test_credit_gone_when_the_price_arrives_fails_with_insufficient_credit(market, clock):
    svc = market(feed_route("spot"))
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc, credit="0")
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    report = await worker(svc).run_pass()
    assert report.dispatched == 0 and report.failed == 1 and engine.calls == []
    (item,) = item_rows(svc, bid)
    assert (item.status, item.reason, item.result_status) == ("failed", "insufficient_credit", 402)
    assert item.reservation_id is None


async def test_cancel_stops_waiting_items_while_claimed_work_finishes(market, clock):
    svc = market(feed_route("spot"))
    engine = BlockingEngine("late answer")
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    w = deferred_batch_worker(svc, per_pass=1, book=worker(svc).book)
    async with asgi_client(svc, worker=False) as http:
        bid = (await submit(http, acct.headers, batch_body(3))).json()["id"]
        set_price(svc, "spot", *CHEAP)
        running = asyncio.create_task(w.run_pass())
        await settles(engine.entered.wait())
        r = await http.post(f"/v1/batches/{bid}/cancel", headers=acct.headers)
        assert r.json()["status"] == "canceling"
        assert r.json()["request_counts"] == {
            **r.json()["request_counts"],
            "dispatched": 1,
            "canceled": 2,
        }
        engine.release.set()
        await settles(running)
        done = (await http.get(f"/v1/batches/{bid}", headers=acct.headers)).json()
    assert done["status"] == "canceled"
    assert [r["status"] for r in done["requests"]] == ["succeeded", "canceled", "canceled"]


async def test_ten_items_per_pass_most_urgent_first(market, clock):
    svc = market(fixed_route("flat", "0.001", "0.004"))
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("flat", engine)
    acct = make_account(svc, credit="5")
    late = await _submit(svc, acct, batch_body(8, completion_window="24h"))
    soon = await _submit(svc, acct, batch_body(8, completion_window="1h"))
    first = await worker(svc).run_pass()
    assert first.dispatched == 10
    assert statuses(svc, soon) == ["succeeded"] * 8
    assert statuses(svc, late).count("succeeded") == 2
    await worker(svc).run_pass()
    assert statuses(svc, late) == ["succeeded"] * 8


async def test_the_loop_follows_a_price_feed_file_and_the_clock(market, clock, tmp_path):
    feed = tmp_path / "prices.json"

    def write(inp, out):
        feed.write_text(
            json.dumps(
                {"prices": [{"route": "spot", "input_per_mtok": inp, "output_per_mtok": out}]}
            )
        )

    write(*HALF)
    svc = market(
        feed_route("spot"),
        price_feed=str(feed),
        price_feed_interval_s=15.0,
        market_interval_s=15.0,
    )
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    async with asgi_client(svc) as http:
        bid = (await submit(http, acct.headers, batch_body(1))).json()["id"]
        for _ in range(3):
            clock.advance(15)
            await asyncio.sleep(0.05)
        assert statuses(svc, bid) == ["waiting"]
        write(*CHEAP)
        clock.advance(15)
        await eventually_ticking(clock, lambda: statuses(svc, bid) == ["succeeded"], ticks=10)


async def test_the_loop_expires_what_never_qualifies(market, clock):
    svc = market(feed_route("spot"), market_interval_s=15.0)
    acct = make_account(svc)
    async with asgi_client(svc) as http:
        bid = (await submit(http, acct.headers, batch_body(1, completion_window="1h"))).json()["id"]
        clock.advance(3600)
        await eventually_ticking(clock, lambda: statuses(svc, bid) == ["expired"])


def test_policy_comes_from_settings(market):
    assert isinstance(worker(market()).policy, FirstEligible)
    assert isinstance(worker(market(market_policy="deadline_aware")).policy, DeadlineAware)


class Waits:
    name = "waits"

    def choose(self, item, offers, direct, now):
        return None


class Rogue:
    """Returns an offer the rule refuses: the worker must not spend on it."""

    name = "rogue"

    def choose(self, item, offers, direct, now):
        return next(o for o in offers if o.route == "nocaps")


async def test_the_worker_follows_the_policy_but_never_past_the_rule(market, clock):
    svc = market(feed_route("spot"), feed_route("nocaps", caps=False))
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("spot", engine)
    svc.engines.set("nocaps", engine)
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    set_price(svc, "nocaps", "0", "0")
    book = worker(svc).book
    assert (await deferred_batch_worker(svc, policy=Waits(), book=book).run_pass()).dispatched == 0
    assert (await deferred_batch_worker(svc, policy=Rogue(), book=book).run_pass()).dispatched == 0
    assert statuses(svc, bid) == ["waiting"] and engine.calls == []
    assert balance(svc, acct).held == 0
    assert (await deferred_batch_worker(svc, book=book).run_pass()).succeeded == 1


@pytest.mark.postgres
async def test_on_postgres_with_a_configured_key(make_service):
    from batchyard.core.sealing import generate_key, key_text

    svc = make_service(
        postgres=True,
        batch_encryption_key=key_text(generate_key()),
        catalog=catalog(feed_route("spot")),
    )
    svc.engines.set("spot", ScriptedEngine("x", clock=svc.clock))
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(3))
    set_price(svc, "spot", *CHEAP)
    # Two workers on one database: each item is claimed once.
    book = worker(svc).book
    a, b = deferred_batch_worker(svc, book=book), deferred_batch_worker(svc, book=book)
    ra, rb = await asyncio.gather(a.run_pass(), b.run_pass())
    assert ra.dispatched + rb.dispatched == 3
    assert statuses(svc, bid) == ["succeeded"] * 3
    assert svc.db.read_sync(ledger.audit) == []
    acts = svc.db.read_sync(lambda c: list_activity(c, acct.org_id))
    assert sorted(a["kind"] for a in acts) == ["charge"] * 3 + ["dispatch"] * 3


def test_offers_carry_fallbacks_and_survive_cycles(market, clock):
    svc = market(feed_route("a", fallbacks=["b"]), feed_route("b", fallbacks=["a"]))
    set_price(svc, "a", *CHEAP)
    offer = worker(svc).prices.offer("a", clock.now())
    assert offer == RouteOffer(
        "a",
        Price(Decimal("0.008"), Decimal("0.03")),
        True,
        (RouteOffer("b", None, True, ()),),
    )
    assert all_items(svc) == []


async def test_a_body_sealed_under_another_key_fails_once_instead_of_every_pass(market, clock):
    from batchyard.core.sealing import Sealer, generate_key
    from batchyard.work.batch_key import BatchKey

    svc = market(feed_route("spot"))
    engine = ScriptedEngine("x", clock=clock)
    svc.engines.set("spot", engine)
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    w = deferred_batch_worker(svc, book=worker(svc).book)
    w.key = BatchKey(Sealer(generate_key()))  # the operator swapped the key
    report = await w.run_pass()
    assert report.failed == 1 and engine.calls == []
    (item,) = item_rows(svc, bid)
    assert (item.status, item.reason, item.reservation_id) == ("failed", "internal_error", None)
    assert balance(svc, acct).held == 0


async def test_a_restarted_worker_restores_the_market_history_it_learns_from(market, clock):
    from batchyard.store.market_history import load_history

    svc = market(feed_route("spot"))
    svc.engines.set("spot", ScriptedEngine("x", clock=clock))
    set_price(svc, "spot", *HALF)
    book = worker(svc).book
    first = deferred_batch_worker(svc, policy=DeadlineAware(), book=book)
    for _ in range(3):  # quiet passes: the market is watched and saved all the same
        await first.run_pass()
        clock.advance(120)
    stored = svc.db.read_sync(lambda c: load_history(c, 0))
    assert [len(bins) for bins in stored.values()] == [3]
    assert all(best == pytest.approx(50.0) for _, best in next(iter(stored.values())))
    again = deferred_batch_worker(svc, policy=DeadlineAware(), book=book)
    assert await again.memory.restore() == 3
    assert again.policy.saved() == first.policy.saved()  # type: ignore[attr-defined]
    # A policy that learns nothing is left alone.
    assert await deferred_batch_worker(svc, book=book).memory.restore() == 0


async def test_a_history_that_cannot_be_saved_does_not_stop_dispatch(market, clock, monkeypatch):
    from batchyard.store import market_history

    def broken(*_a, **_k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(market_history, "save_history", broken)
    svc = market(feed_route("spot"))
    svc.engines.set("spot", ScriptedEngine("x", clock=clock))
    acct = make_account(svc)
    bid = await _submit(svc, acct, batch_body(1))
    set_price(svc, "spot", *CHEAP)
    book = worker(svc).book
    report = await deferred_batch_worker(svc, policy=DeadlineAware(), book=book).run_pass()
    assert report.succeeded == 1 and statuses(svc, bid) == ["succeeded"]
