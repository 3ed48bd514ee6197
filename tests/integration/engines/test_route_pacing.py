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
from tests.support.waits import until

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


async def quiet(up: FakeUpstream, polls: int = 10) -> None:
    """Wait until the upstream has seen no new request for ``polls`` polls in a row.

    Time stands still (the ManualClock), so a route held by a Retry-After sends nothing
    more; calls that were already past the pacer when the refusal came still land.
    """
    seen, still = -1, 0
    for _ in range(2000):
        now = up.requests
        answered = sum(up.statuses.values()) == now
        still = still + 1 if (now == seen and answered) else 0
        if still >= polls:
            return
        seen = now
        await asyncio.sleep(0.02)
    raise AssertionError("the upstream never went quiet")


@pytest.mark.parametrize("window", ["fixed", "rolling"])
@pytest.mark.parametrize("refuse_first", [0, 2])
async def test_a_strict_upstream_s_429s_are_retried_after_retry_after_and_never_fail_the_client(
    make_service, clock, window, refuse_first
) -> None:
    up = FakeUpstream(mode="echo", rpm=120, window=window, time_fn=clock.time)  # 2 a second
    if refuse_first:
        # A 429 with Retry-After and no x-ratelimit-* before anything else: the gateway
        # learns nothing from it but to wait, and must retry those calls itself.
        up.fail_next(refuse_first, status=429, retry_after=1)
    with up:
        svc = make_service(catalog=catalog(up.base_url))
        acct = make_account(svc, credit="100")
        async with asgi_client(svc) as http:
            calls = [
                asyncio.create_task(
                    http.post("/v1/chat/completions", json=BODY, headers=acct.headers)
                )
                for _ in range(CALLS)
            ]
            try:
                # The cold start lets a few calls out. Whatever the upstream says first (a
                # refusal's Retry-After, or "0 remaining" on an answer) holds the route, and
                # the clock stands still: wait until nothing more goes out.
                await until(lambda: up.requests >= 1, "the first call")
                await quiet(up)
                refused = up.rate_limited
                if refuse_first:
                    assert refused >= 1  # the header-less 429 came first
                assert sum(c.done() for c in calls) == up.statuses[200] <= 2
                hold = await svc.limiter.try_acquire("route:remote", [])
                assert not hold.allowed and hold.retry_after > 0

                # Move time on a little at a time until every call has landed.
                for _ in range(400):
                    if all(c.done() for c in calls):
                        break
                    clock.advance(0.25)
                    await asyncio.sleep(0.02)
                else:
                    pending = sum(not c.done() for c in calls)
                    raise AssertionError(
                        f"{pending} calls still waiting at t={clock.time()}: {dict(up.statuses)}"
                    )
                answers = await asyncio.gather(*calls)
            finally:
                for c in calls:
                    c.cancel()

        assert [r.status_code for r in answers] == [200] * CALLS, [r.text for r in answers]
        assert up.statuses[200] == CALLS
        assert svc.dispatcher.pacer.state(svc.catalog.routes["remote"]).rpm == 120
        if not refuse_first:
            # The limit was learned from the first answer's headers: every later call
            # was paced into the upstream's seconds, so no refusal came after that.
            assert up.rate_limited == refused
