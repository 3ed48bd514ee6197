"""The Redis limiter fails closed on admissions and never fails a call after the fact.

No Redis is needed: the limiter points at a loopback port nothing listens on,
which is what a stopped Redis looks like to a client (the outage test in
tests/faults/test_redis_outage.py stops and starts a real one).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from batchyard.core.clock import ManualClock
from batchyard.core.limits import Limit
from batchyard.errors import LimiterUnavailable
from batchyard.store.redis_limiter import RedisLimiter
from tests.support.server import free_port

RPM = Limit("rpm", per_minute=60)


@pytest.fixture
async def limiter() -> AsyncIterator[RedisLimiter]:
    lim = RedisLimiter(f"redis://127.0.0.1:{free_port()}/0", ManualClock())
    yield lim
    await lim.close()


async def test_an_admission_is_refused_with_limiter_unavailable(limiter: RedisLimiter) -> None:
    with pytest.raises(LimiterUnavailable) as caught:
        await limiter.try_acquire("org:a", [(RPM, 1.0)])
    assert (caught.value.status, caught.value.retryable) == (503, True)
    assert caught.value.code == "limiter_unavailable"
    assert "ConnectionError" in caught.value.message
    with pytest.raises(LimiterUnavailable):
        await limiter.take_slot("org:a", 2, 30.0)


async def test_what_follows_a_call_only_logs(
    limiter: RedisLimiter, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="batchyard.limits"):
        await limiter.free_slot("org:a", "slot-token")
        await limiter.renew_slot("org:a", "slot-token", 30.0)
        await limiter.adjust("org:a", RPM, -1.0)
        await limiter.penalize("route:fake", 1e12)
    assert len([r for r in caplog.records if r.name == "batchyard.limits"]) == 4
