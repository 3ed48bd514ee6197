"""Stuck work is seen: a batch whose route is down waits, and is listed, counted and explained.

The route is an ``openai_http`` route at a loopback port nothing listens on, so
every call is refused for real; time is the service's ManualClock, moved by the
test. ``batchyard stuck`` itself is run once against the same database.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
from click.testing import CliRunner

from batchyard.app import stuck_watch
from batchyard.cli.main import cli
from batchyard.core.catalog import Catalog, RouteSpec, default_catalog
from batchyard.core.clock import ManualClock, SystemClock
from batchyard.core.sealing import generate_key, key_text
from batchyard.errors import UpstreamUnreachable
from batchyard.service import Service
from batchyard.store import activity
from batchyard.work.stuck_watch import listing
from tests.support.accounts import make_account
from tests.support.deferred_batches import batch_body, eventually, feed_route, set_price, submit
from tests.support.deferred_batches import worker as deferred_worker
from tests.support.fake_upstream import FakeUpstream
from tests.support.file_batches import (
    chat_line,
    create,
    jsonl,
    lines_of,
    parse_lines,
    upload,
    worker,
)
from tests.support.runs import Api, fast_runs, http_catalog
from tests.support.server import asgi_client
from tests.support.services import ServiceFactory
from tests.support.workspace import answer_with

STUCK_AFTER = 60.0


def closed_port_url() -> str:
    """A loopback base URL that refuses connections (an upstream that was, and is gone)."""
    with FakeUpstream() as gone:
        return gone.base_url


def down_route_service(make_service: ServiceFactory, **overrides: Any) -> Service:
    """kettei-fat on an ``openai_http`` route whose upstream refuses every connection."""
    base = default_catalog()
    route = RouteSpec(
        id="fat",
        model="kettei-fat",
        engine="openai_http",
        upstream_model="fat-1",
        base_url=closed_port_url(),
    )
    catalog = Catalog(list(base.models.values()), [*base.routes.values(), route])
    return make_service(catalog=catalog, stuck_after_s=STUCK_AFTER, **overrides)


def stuck_now(svc: Service) -> list[dict[str, Any]]:
    return svc.db.read_sync(lambda c: listing(c, svc.clock.now(), STUCK_AFTER))


def stuck_entries(svc: Service, org_id: str) -> list[dict[str, Any]]:
    acts = svc.db.read_sync(lambda c: activity.list_activity(c, org_id))
    return [a for a in acts if a["kind"] == "work_stuck"]


@pytest.mark.parametrize("postgres", [False, pytest.param(True, marks=pytest.mark.postgres)])
async def test_a_batch_whose_route_is_down_waits_and_is_listed_as_stuck_in_time(
    make_service, postgres
):
    # PostgreSQL has no key file beside it: the batch key comes from the settings.
    key = {"batch_encryption_key": key_text(generate_key())} if postgres else {}
    svc = down_route_service(make_service, postgres=postgres, **key)
    clock = svc.clock
    acct = make_account(svc, credit="1")
    content = jsonl([chat_line(f"r{i}", model="kettei-fat") for i in range(3)])
    async with asgi_client(svc, worker=False) as http:
        f = (await upload(http, acct.headers, content)).json()
        batch = (await create(http, acct.headers, f["id"])).json()
    assert batch["status"] == "in_progress"
    watch = stuck_watch(svc)
    files = worker(svc)
    try:
        await files.tick()
        # Every call is refused at the connection: nothing was sent, so no line fails.
        await eventually(lambda: svc.dispatcher.health.trouble("fat") is not None)
        assert svc.dispatcher.health.trouble("fat").kind == "route_down"
        await watch.sweep()
        clock.advance(STUCK_AFTER - 1)
        await files.tick()
        assert await watch.sweep() == 0 and stuck_now(svc) == []
        clock.advance(1)
        await files.tick()
        assert await watch.sweep() == 1
        states = {line.state for line in lines_of(svc, batch["id"])}
        assert states <= {"pending", "dispatched"}
    finally:
        await files.stop()
    (listed,) = stuck_now(svc)
    assert listed["kind"] == "file_batch" and listed["id"] == batch["id"]
    assert listed["reason"] == "route_down" and "route fat" in listed["detail"]
    assert listed["left"] == 3 and listed["models"] == ["kettei-fat"]
    # Its owner is told once a standstill, and the worker counts it.
    (entry,) = stuck_entries(svc, acct.org_id)
    assert entry["ref"] == batch["id"] and entry["detail"]["reason"] == "route_down"
    assert await watch.sweep() == 0 and len(stuck_entries(svc, acct.org_id)) == 1
    scraped = svc.metrics.exposition(None).decode()
    assert 'batchyard_work_stuck_total{kind="file_batch",reason="route_down"} 1.0' in scraped


async def test_with_no_worker_watching_the_reason_is_no_worker(service):
    answer_with(service)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
    service.clock.advance(service.settings.stuck_after_s)
    (listed,) = service.db.read_sync(
        lambda c: listing(c, service.clock.now(), service.settings.stuck_after_s)
    )
    assert listed["id"] == batch["id"] and listed["reason"] == "no_worker"
    assert "batchyard worker" in listed["detail"]


async def test_the_command_lists_stuck_work_with_its_reason(make_service, tmp_path):
    # The command reads the system clock: the service's clock starts far enough back
    # that its batch has stood still for longer than stuck_after_s by now.
    clock = ManualClock(SystemClock().now() - timedelta(seconds=STUCK_AFTER + 30))
    svc = down_route_service(make_service, clock=clock)
    acct = make_account(svc, credit="1")
    async with asgi_client(svc, worker=False) as http:
        f = (await upload(http, acct.headers, jsonl([chat_line("a", model="kettei-fat")]))).json()
        batch = (await create(http, acct.headers, f["id"])).json()
    svc.dispatcher.health.failed("fat", "route_down", clock.now(), "upstream unreachable")
    clock.advance(STUCK_AFTER + 20)
    assert await stuck_watch(svc).sweep() == 1
    env = {"BATCHYARD_STUCK_AFTER_S": str(STUCK_AFTER), "BATCHYARD_HOME": str(tmp_path)}
    args = ["stuck", "--json", "--database", svc.settings.database_url]
    got = CliRunner().invoke(cli, args, env=env)
    assert got.exit_code == 1, got.output
    (row,) = [json.loads(line) for line in got.output.splitlines() if line.startswith("{")]
    assert (row["id"], row["kind"], row["reason"]) == (batch["id"], "file_batch", "route_down")
    table = CliRunner().invoke(cli, args[:1] + args[2:], env=env)
    assert table.exit_code == 1 and batch["id"] in table.output and "route_down" in table.output


@pytest.mark.parametrize("end", ["expire", "cancel"])
async def test_an_expired_or_canceled_file_batch_keeps_every_finished_line(service, end):
    refused = UpstreamUnreachable("upstream unreachable (ClientConnectorError)")
    engine = answer_with(service, "hello")
    # The first call is answered; every later one is refused at the connection, so the
    # other lines wait for the route until the batch ends.
    engine.fail_next(None, *[refused] * 1000)
    acct = make_account(service, credit="1")
    content = jsonl([chat_line(f"r{i}") for i in range(3)])
    files = worker(service)
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, content)).json()
        batch = (await create(http, acct.headers, f["id"], window="1h")).json()
        await files.tick()
        await eventually(
            lambda: sum(x.state == "succeeded" for x in lines_of(service, batch["id"])) == 1
        )
        if end == "expire":
            # The window passes as time does, in steps well inside a lease: the worker
            # renews the leases of the lines it holds between refused calls.
            for _ in range(361):
                service.clock.advance(10)
                await files.tick()
                await asyncio.sleep(0.005)
        else:
            r = await http.post(f"/v1/batches/{batch['id']}/cancel", headers=acct.headers)
            assert r.status_code == 200, r.text
        final = "expired" if end == "expire" else "cancelled"

        async def status() -> dict[str, Any]:
            r = await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)
            return r.json()

        for _ in range(200):
            service.clock.advance(1)  # the pipeline's pause after a refused call
            await files.tick()
            done = await status()
            if done["status"] == final:
                break
            await asyncio.sleep(0.005)
        await files.stop()
        assert done["status"] == final, done["request_counts"]
        out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=acct.headers)
        errors = await http.get(f"/v1/files/{done['error_file_id']}/content", headers=acct.headers)
    answered = parse_lines(out.content)
    assert len(answered) == 1 and answered[0]["response"]["status_code"] == 200
    assert answered[0]["response"]["body"]["choices"][0]["message"]["content"] == "hello"
    code = "batch_expired" if end == "expire" else "batch_cancelled"
    unanswered = parse_lines(errors.content)
    assert len(unanswered) == 2 and {x["error"]["code"] for x in unanswered} == {code}
    assert {x["custom_id"] for x in answered + unanswered} == {"r0", "r1", "r2"}
    assert done["request_counts"]["completed"] == 1


async def test_a_canceled_message_batch_returns_every_finished_result(service):
    refused = UpstreamUnreachable("upstream unreachable (ClientConnectorError)")
    engine = answer_with(service, "hello")
    engine.fail_next(None, *[refused] * 1000)
    acct = make_account(service, credit="1")
    anthropic = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    requests = [
        {
            "custom_id": f"r{i}",
            "params": {
                "model": "kettei-core",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "Say hi."}],
            },
        }
        for i in range(3)
    ]
    path = "/v1/messages/batches"
    files = worker(service)
    async with asgi_client(service, worker=False) as http:
        batch = (await http.post(path, json={"requests": requests}, headers=anthropic)).json()
        await files.tick()
        await eventually(
            lambda: sum(x.state == "succeeded" for x in lines_of(service, batch["id"])) == 1
        )
        # The other two wait for their route; past stuck_after_s the batch is stuck for it.
        after = service.settings.stuck_after_s
        for _ in range(int(after // 10) + 1):
            service.clock.advance(10)
            await files.tick()
            await asyncio.sleep(0.005)
        assert await stuck_watch(service).sweep() == 1
        (listed,) = service.db.read_sync(lambda c: listing(c, service.clock.now(), after))
        assert (listed["kind"], listed["id"], listed["left"]) == ("message_batch", batch["id"], 2)
        assert listed["reason"] == "route_down"
        r = await http.post(f"{path}/{batch['id']}/cancel", headers=anthropic)
        assert r.status_code == 200, r.text
        for _ in range(200):
            service.clock.advance(1)
            await files.tick()
            done = (await http.get(f"{path}/{batch['id']}", headers=anthropic)).json()
            if done["processing_status"] == "ended":
                break
            await asyncio.sleep(0.005)
        await files.stop()
        out = await http.get(f"{path}/{batch['id']}/results", headers=anthropic)
    assert done["processing_status"] == "ended", done
    got = {x["custom_id"]: x["result"] for x in map(json.loads, out.text.splitlines())}
    assert set(got) == {"r0", "r1", "r2"}
    kinds = sorted(r["type"] for r in got.values())
    assert kinds == ["canceled", "canceled", "succeeded"]
    (answered,) = [r for r in got.values() if r["type"] == "succeeded"]
    assert answered["message"]["content"][0]["text"] == "hello"
    assert done["request_counts"] == {**done["request_counts"], "succeeded": 1, "canceled": 2}


async def test_a_deferred_batch_waiting_on_the_market_is_stuck_for_the_market(market):
    svc = market(feed_route("spot"), stuck_after_s=STUCK_AFTER)
    acct = make_account(svc)
    async with asgi_client(svc, worker=False) as http:
        r = await submit(http, acct.headers, batch_body(2))
    assert r.status_code == 201, r.text
    set_price(svc, "spot", "0.05", "0.2")  # 50 % off: short of the batch's 90 %
    await deferred_worker(svc).run_pass()
    svc.clock.advance(STUCK_AFTER)
    set_price(svc, "spot", "0.05", "0.2")  # still fresh, still short
    assert await stuck_watch(svc).sweep() == 1
    (listed,) = stuck_now(svc)
    assert (listed["kind"], listed["id"], listed["left"]) == ("deferred_batch", r.json()["id"], 2)
    assert listed["reason"] == "market" and "discount" in listed["detail"]


async def test_a_run_whose_route_is_down_waits_and_is_stuck_for_its_route(make_service):
    svc = make_service(
        catalog=http_catalog(closed_port_url()), runs=fast_runs(), stuck_after_s=STUCK_AFTER
    )
    acct = make_account(svc, credit="5")
    rows = [{"text": f"ticket {i}"} for i in range(3)]
    body = {
        "model": {"type": "base", "id": "kettei-core"},
        "input": {"type": "field", "field": "text"},
        "output": {"type": "field", "field": "answer"},
        "sampling": {"maxOutputTokens": 8},
    }
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        run_id, _ = await api.confirmed(rows, body)
        await eventually(lambda: svc.dispatcher.health.trouble("fake") is not None)
        svc.clock.advance(STUCK_AFTER)
        assert await stuck_watch(svc).sweep() == 1
        run = await api.get(run_id)
        (listed,) = stuck_now(svc)
        await api.post(run_id, "cancel")  # ends it, so the service stops clean
    assert run["status"] == "running"  # no row failed: all three are still left below
    assert (listed["kind"], listed["id"], listed["left"]) == ("run", run_id, 3)
    assert listed["reason"] == "route_down" and "route fake" in listed["detail"]
