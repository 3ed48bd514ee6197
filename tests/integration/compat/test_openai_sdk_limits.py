"""Issue 22: the official ``openai`` SDK, default retries, a burst over tier 0's limit.

Forty calls at once against a tier allowing 30 a minute with a burst of five:
before, every refused caller was told the same ~10 s, all retries came back
together and were refused again, and 18 of 40 ended in ``RateLimitError``. Now
each refused call is given its own place in line and told its own time, so the
SDK's own two retries (honouring ``retry-after-ms``) land each call in its place.

The SDK sleeps real time on ``Retry-After``, so the tier here is tier 0 sped up
four times (120 a minute, the same burst and concurrency, a quarter of the
server's queue): the same schedule in about fifteen seconds. Nothing here is
timed, but the speed-up shrinks what the server itself does not: a call holds
one of the five concurrency slots for as long as the server takes to answer it,
and a call that finds them full waits the (shrunk) queue, then is told to retry
in a second. Sped up twenty times, the queue was half a second, and on a loaded
machine (calls taking longer than that) every retry found the slots full and
calls ended in ``RateLimitError``; at four times a call has 2.5 s, as tier 0's
own ten seconds has room for a slow server.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import openai
import pytest

from batchyard.core.tiers import DEFAULT_TIERS, Tier
from batchyard.engines.scripted import ScriptedEngine
from tests.support.threaded_server import Gateway, ServerThread
from tests.support.waits import HANG_S

SPEED = 4
TIER0 = DEFAULT_TIERS[0]
FAST_TIER0 = Tier(
    0,
    TIER0.requests_per_minute * SPEED,
    TIER0.tokens_per_minute * SPEED,
    TIER0.estimate_tokens_per_minute * SPEED,
    Decimal("0"),
    concurrency=TIER0.max_in_flight,
)


@pytest.fixture(
    scope="module",
    params=[
        "memory",
        pytest.param("sql", id="sql"),
        pytest.param("redis://127.0.0.1:6379/0", id="redis", marks=pytest.mark.redis),
    ],
)
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """The server, its limits in process, in its database, or in Redis (places shared alike)."""
    home = tmp_path_factory.mktemp("sdk-limits")
    old_home = os.environ.get("BATCHYARD_HOME")
    os.environ["BATCHYARD_HOME"] = str(home)
    server = ServerThread(
        home,
        overrides={
            "tiers": (FAST_TIER0, *DEFAULT_TIERS[1:]),
            "limits_queue_s": 10.0 / SPEED,
            "limiter_url": request.param,
        },
        engines={"embedded": ScriptedEngine("hi")},
    )
    try:
        yield server.start()
    finally:
        server.stop()
        if old_home is None:
            os.environ.pop("BATCHYARD_HOME", None)
        else:
            os.environ["BATCHYARD_HOME"] = old_home
    assert server.problems == [], server.problems


def test_forty_calls_at_tier_0_with_default_retries_are_all_answered(gateway):
    statuses: list[int] = []
    lock = threading.Lock()

    def seen(response: httpx.Response) -> None:
        with lock:
            statuses.append(response.status_code)

    http = httpx.Client(event_hooks={"response": [seen]}, timeout=HANG_S)
    sdk = openai.OpenAI(
        base_url=gateway.url, api_key=gateway.org("storm", tier=0), http_client=http
    )
    assert sdk.max_retries == 2  # the SDK's default, untouched

    def one(i: int) -> str | None:
        answer = sdk.chat.completions.create(
            model="kettei-core",
            messages=[{"role": "user", "content": f"Say hi to number {i}"}],
            max_tokens=4,
        )
        return answer.choices[0].message.content

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(one, range(40)))
    http.close()
    assert answers == ["hi"] * 40
    # Every call answered, and the burst was refused once at most: no storm of retries.
    assert statuses.count(200) == 40
    refused = statuses.count(429)
    assert set(statuses) <= {200, 429}
    assert 0 < refused <= 40 - TIER0.max_in_flight
