"""A busy event loop is not a Redis outage: the shared limiter keeps admitting.

The Redis client's timeout is measured by the event loop. When the loop is late
(a loaded machine, a long synchronous step, a GIL shared with other threads),
the reply and the timeout are both due when it comes back, and the timeout
runs first: an answer that was already there read as "Redis cannot be
reached", a 503 to the client. A two-second budget did that once in a loaded
suite run (the SDK limits test, Redis variant). The loop here is blocked for
three seconds right after the admission's command went out; the admission must
still succeed.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from batchyard.core.clock import ManualClock
from batchyard.core.limits import Limit
from batchyard.store import redis_limiter
from batchyard.store.redis_limiter import RedisLimiter
from tests.conftest import REDIS_URL

RPM = Limit("rpm", per_minute=60)
BUSY_S = 3.0


async def test_an_admission_survives_a_loop_busy_past_two_seconds() -> None:
    assert redis_limiter.TIMEOUT_S > BUSY_S
    lim = RedisLimiter(REDIS_URL, ManualClock(), prefix=f"batchyard-test:{uuid.uuid4().hex}:")
    try:
        await lim.try_acquire("org:warm", [(RPM, 1.0)])  # connected, scripts loaded
        admission = asyncio.create_task(lim.try_acquire("org:a", [(RPM, 1.0)]))
        for _ in range(5):  # until the command is written and its reply awaited
            await asyncio.sleep(0)
        time.sleep(BUSY_S)  # the loop is busy elsewhere: nothing of it runs
        await admission  # no LimiterUnavailable
    finally:
        await lim.close()
