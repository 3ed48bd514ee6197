"""A strict upstream's 429s never reach the client: waited out, retried, and the limit learned.

The fake upstream counts its per-second window on the service's ManualClock,
so the test moves time instead of sleeping: the upstream refuses what its
second has no room for (with Retry-After and ``x-ratelimit-*``), the gateway
holds the route until then and sends again, and every client call answers 200,
billed once.
"""

from __future__ import annotations

import asyncio

import pytest

from batchyard.core.catalog import catalog_from_config
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.server import asgi_client

BODY = {"model": "remote-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CALLS = 6


def catalog(base_url: str):
    return catalog_from_config(
        {
            "models": [
                {
                    "id": "remote-model",
                    "input_per_mtok": "1",
                    "output_per_mtok": "2",
                    "context_window": 4096,
                }
            ],
            # No rpm declared: the gateway must learn the upstream's limit.
            "routes": [
                {
                    "id": "remote",
                    "model": "remote-model",
                    "engine": "openai_http",
                    "base_url": base_url,
                    "upstream_model": "fake",
                }
            ],
        }
    )


async def until(predicate, what: str, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not reached: {what}")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("window", ["fixed"])
async def test_a_strict_upstream_s_429s_are_retried_after_retry_after_and_never_fail_the_client(
    make_service, clock, window
) -> None:
    up = FakeUpstream(mode="echo", rpm=120, window=window, time_fn=clock.time)  # 2 a second
    with up:
        svc = make_service(catalog=catalog(up.base_url))
        acct = make_account(svc, credit="100")
        async with asgi_client(svc, timeout=60) as http:
            calls = [
                asyncio.create_task(
                    http.post("/v1/chat/completions", json=BODY, headers=acct.headers)
                )
                for _ in range(CALLS)
            ]
            # The cold start lets a few calls out; the upstream's second has room for two.
            await until(lambda: up.statuses[200] == 2 and up.rate_limited >= 1, "a refusal")
            refused = up.rate_limited
            # Until its Retry-After has passed, nothing more is sent.
            await asyncio.sleep(0.05)
            assert up.statuses[200] == 2 and up.rate_limited == refused
            hold = await svc.limiter.try_acquire("route:remote", [])
            assert not hold.allowed and hold.retry_after > 0
            assert svc.dispatcher.pacer.state(svc.catalog.routes["remote"]).rpm == 120

            # Move time on a little at a time until every call has landed.
            for _ in range(200):
                if all(c.done() for c in calls):
                    break
                clock.advance(0.25)
                await asyncio.sleep(0.02)
            answers = await asyncio.gather(*calls)

        assert [r.status_code for r in answers] == [200] * CALLS, [r.text for r in answers]
        assert up.statuses[200] == CALLS
        # Learned after the first refusal: the rest were paced into the upstream's seconds.
        assert up.rate_limited == refused
