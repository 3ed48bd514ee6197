"""The fake upstream enforces its per-second limit and its scripted faults, over real HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.waits import HANG_S


class PinnedTime:
    """The limiter's clock, moved by the test so windows never race the wall clock."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}


@pytest.fixture
def clock() -> PinnedTime:
    return PinnedTime(1000.25)


@pytest.fixture
def up(clock: PinnedTime):
    with FakeUpstream(rpm=600, time_fn=clock) as server:
        yield server


def post(client: httpx.Client, up: FakeUpstream, body: dict | None = None) -> httpx.Response:
    return client.post(f"{up.base_url}/chat/completions", json=body or BODY)


def test_limit_is_rpm_over_sixty_per_second_window(up: FakeUpstream, clock: PinnedTime) -> None:
    assert up.per_second == 10
    with httpx.Client(timeout=HANG_S) as client:
        statuses = [post(client, up).status_code for _ in range(13)]
        assert statuses == [200] * 10 + [429] * 3
        assert up.rate_limited == 3
        assert up.requests == 13

        limited = post(client, up)
        assert limited.headers["retry-after"] == "1"
        assert limited.headers["retry-after-ms"] == "750"
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        assert limited.headers["x-ratelimit-reset-requests"] == "750ms"
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"

        clock.now = 1001.0  # the next one-second window
        fresh = post(client, up)
        assert fresh.status_code == 200
        assert fresh.headers["x-ratelimit-limit-requests"] == "600"
        assert fresh.headers["x-ratelimit-remaining-requests"] == "9"
        assert fresh.headers["x-ratelimit-reset-requests"] == "1000ms"


def test_limit_can_change_while_running(up: FakeUpstream, clock: PinnedTime) -> None:
    up.rpm = 120
    with httpx.Client(timeout=HANG_S) as client:
        assert [post(client, up).status_code for _ in range(3)] == [200, 200, 429]
        up.rpm = None
        assert post(client, up).status_code == 200


def test_echo_answers_with_word_count_usage(up: FakeUpstream) -> None:
    with httpx.Client(timeout=HANG_S) as client:
        data = post(client, up).json()
    assert data["choices"][0]["message"]["content"] == "echo: hi there"
    assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert up.last_request is not None and up.last_request["max_tokens"] == 8


def test_scripted_failures_then_malformed_then_normal(up: FakeUpstream) -> None:
    up.fail_next(2, status=503, retry_after=7)
    up.malformed_next(1, kind="missing_usage")
    up.malformed_next(1)
    with httpx.Client(timeout=HANG_S) as client:
        first, second = post(client, up), post(client, up)
        assert (first.status_code, first.headers["retry-after"]) == (503, "7")
        assert second.status_code == 503
        missing = post(client, up)
        assert missing.status_code == 200 and "usage" not in missing.json()
        broken = post(client, up)
        with pytest.raises(json.JSONDecodeError):
            json.loads(broken.content)
        assert post(client, up).status_code == 200
    assert up.statuses[503] == 2


def test_json_schema_answers_first_enum_values() -> None:
    schema = {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["spam", "ham"]},
            "score": {"type": "integer", "enum": [3, 1]},
            "why": {"type": "string"},
        },
    }
    body = {**BODY, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    with FakeUpstream() as up, httpx.Client(timeout=HANG_S) as client:
        content = post(client, up, body).json()["choices"][0]["message"]["content"]
    assert json.loads(content) == {"label": "spam", "score": 3, "why": ""}


def test_instant_mode_and_unknown_routes() -> None:
    with FakeUpstream(mode="instant") as up, httpx.Client(timeout=HANG_S) as client:
        responses = [post(client, up) for _ in range(50)]
        assert {r.json()["choices"][0]["message"]["content"] for r in responses} == {"ok"}
        assert client.get(f"{up.base_url}/nothing").status_code == 404
        assert up.requests == 51


def test_api_key_is_checked_when_set() -> None:
    with FakeUpstream(api_key="sk-test") as up, httpx.Client(timeout=HANG_S) as client:
        assert post(client, up).status_code == 401
        ok = client.post(
            f"{up.base_url}/chat/completions",
            json=BODY,
            headers={"authorization": "Bearer sk-test"},
        )
        assert ok.status_code == 200


async def test_warming_delays_only_the_first_requests_for_a_model() -> None:
    import asyncio

    with FakeUpstream(warm_delay_s={"cold": 0.3}) as up:
        async with httpx.AsyncClient(timeout=HANG_S) as client:
            url = f"{up.base_url}/chat/completions"
            first = await asyncio.gather(
                *[client.post(url, json={**BODY, "model": "cold"}) for _ in range(3)]
            )
            waited_then = up.waited_for_load
            await client.post(url, json={**BODY, "model": "cold"})
    assert all(r.status_code == 200 for r in first)
    assert up.loads == 1  # three cold calls share one load
    assert up.is_warm("cold")
    assert waited_then == 3  # each of them waited for it
    assert up.waited_for_load == 3  # the warm call did not


def _ask(client: httpx.AsyncClient, up: FakeUpstream, text: str) -> Any:
    body = {**BODY, "messages": [{"role": "user", "content": text}]}
    return client.post(f"{up.base_url}/chat/completions", json=body)


async def test_hold_keeps_calls_in_flight_until_release_and_counts_each_arrival() -> None:
    import asyncio

    from tests.support.deferred_batches import eventually

    with FakeUpstream() as up:
        up.hold(after=1)
        async with httpx.AsyncClient(timeout=HANG_S) as client:
            assert (await _ask(client, up, "one")).status_code == 200
            pending = [asyncio.create_task(_ask(client, up, t)) for t in ("two", "three")]
            await eventually(lambda: up.held == 2)
            assert sorted(up.arrived) == ["one", "three", "two"]
            assert up.answered == ["one"]
            assert not any(t.done() for t in pending)

            up.release()
            answers = [
                r.json()["choices"][0]["message"]["content"] for r in await asyncio.gather(*pending)
            ]
            assert answers == ["echo: two", "echo: three"]
            assert sorted(up.answered) == ["one", "three", "two"]
            assert up.held == 0 and up.abandoned == 0

            # Hold again; a caller that hangs up mid-call is counted, never answered.
            up.hold()
            gone = asyncio.create_task(_ask(client, up, "four"))
            await eventually(lambda: up.held == 1)
            gone.cancel()
            await eventually(lambda: up.abandoned == 1 and up.held == 0)
            assert "four" in up.arrived and "four" not in up.answered
