"""Redis stopped while the limiter uses it: the limiter fails closed, then recovers by itself.

The choice (see docs/explanation/outages.md): without the shared limiter no
process can know what the fleet has already admitted, so admitting anyway
could overrun an upstream's limit or a tier's rate for everyone. So a request
that needs an admission is answered 503 ``limiter_unavailable`` with
``retryable: true`` (not 500, no traceback), nothing reaches the upstream and
nothing is held or charged; once Redis answers again the same client's next
request goes through, with no restart. ``/readyz`` says 503 (the limiter) while
it is down and 200 once it is back.

The Redis here is the test's own ``redis-server`` (the shared one on 6379 is
never stopped); the app runs in process on that limiter, with a route whose
``rpm`` the dispatcher paces through Redis, to a fake upstream over loopback.
"""

from __future__ import annotations

import logging

import pytest

from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.private_servers import PrivateRedis
from tests.support.runs import http_catalog
from tests.support.server import asgi_client
from tests.support.services import ServiceFactory

CHAT = {"model": "kettei-core", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_redis_stopped_fails_the_limiter_closed_and_it_recovers_when_redis_returns(
    make_service: ServiceFactory, private_redis: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    with FakeUpstream() as up:
        svc = make_service(
            limiter_url=private_redis.url, catalog=http_catalog(up.base_url, rpm=6000)
        )
        acct = make_account(svc, credit="1")
        async with asgi_client(svc, worker=False) as http:

            async def chat(key: str) -> tuple[int, dict[str, object], str | None]:
                r = await http.post(
                    "/v1/chat/completions",
                    json=CHAT,
                    headers={**acct.headers, "Idempotency-Key": key},
                )
                return r.status_code, r.json(), r.headers.get("x-should-retry")

            status, _, _ = await chat("before")
            assert status == 200
            assert len(up.arrived) == 1
            before = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))

            private_redis.stop()
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                status, body, should_retry = await chat("during")
            error = body["error"]
            assert isinstance(error, dict)
            assert (status, error["code"], error["retryable"]) == (503, "limiter_unavailable", True)
            assert should_retry == "true"
            assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
            # Nothing reached the upstream, nothing is held or charged.
            assert len(up.arrived) == 1
            assert svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id)) == before

            ready = await http.get("/readyz")
            assert ready.status_code == 503 and "limiter" in ready.text

            private_redis.start()
            assert (await http.get("/readyz")).status_code == 200
            # The same key again: the failed attempt was not saved (it was retryable).
            status, _, _ = await chat("during")
            assert status == 200
            assert len(up.arrived) == 2
    after = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert after.held == 0 and after.settled > before.settled
