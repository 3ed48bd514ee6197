"""Retry policy of both clients, against the fake gateway over real HTTP."""

from __future__ import annotations

import socket

import httpx
import pytest

from batchyard.client import AsyncClient, Client, ConnectionFailed
from batchyard.client.pacer import Pacer
from batchyard.client.retries import RetryPolicy, RetryStep, error_from_response
from batchyard.client.sync_pacer import SyncPacer
from batchyard.errors import (
    IdempotencyConflict,
    InsufficientCredit,
    InvalidApiKey,
    ModelWarming,
    RateLimited,
    ServiceUnavailable,
    TooFewOutcomes,
)
from tests.support.fake_gateway import DECISIONS, FakeGateway


class Sleeps:
    """A sync client's clock that records the waits asked for instead of waiting them."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def time(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        self.calls.append(seconds)


class AsyncSleeps(Sleeps):
    """The same for the async client, whose clock's sleep is awaited."""

    async def sleep(self, seconds: float) -> None:  # type: ignore[override]
        self.calls.append(seconds)


def _sync(gw: FakeGateway, sleeps: Sleeps, **kw: object) -> Client:
    return Client(gw.base_url, gw.api_key, clock=sleeps, **kw)  # type: ignore[arg-type]


def _decide_sync(client: Client, **kw: object) -> dict:
    return client.decide(model="kettei-core", decisions=DECISIONS, text="hello there", **kw)  # type: ignore[arg-type,return-value]


def test_rate_limited_waits_retry_after_and_keeps_the_key(gateway: FakeGateway) -> None:
    sleeps = Sleeps()
    gateway.fail_next(1, 429, "rate_limited", retry_after=3)
    with _sync(gateway, sleeps) as client:
        answer = _decide_sync(client)
    assert answer["answers"][0]["decision"] == "sentiment"
    assert sleeps.calls == [3.0]
    calls = gateway.decide_requests()
    assert [r.status for r in calls] == [429, 200]
    assert calls[0].key == calls[1].key and calls[0].key is not None


def test_retries_twice_by_default_then_raises_the_typed_error(gateway: FakeGateway) -> None:
    sleeps = Sleeps()
    gateway.fail_next(3, 503, "model_warming", retry_after=1)
    with _sync(gateway, sleeps) as client, pytest.raises(ModelWarming) as info:
        _decide_sync(client, idempotency_key="my-key-1")
    assert info.value.code == "model_warming"
    assert info.value.retryable is True
    assert info.value.status == 503
    assert sleeps.calls == [1.0, 1.0]
    assert [r.key for r in gateway.decide_requests()] == ["my-key-1"] * 3


def test_max_retries_is_configurable(gateway: FakeGateway) -> None:
    sleeps = Sleeps()
    gateway.fail_next(5, 503, "service_unavailable", retry_after=0)
    with _sync(gateway, sleeps, max_retries=5) as client:
        _decide_sync(client)
    assert len(gateway.decide_requests()) == 6


def test_non_retryable_raises_at_once(gateway: FakeGateway) -> None:
    sleeps = Sleeps()
    gateway.credit = gateway.credit * 0
    with _sync(gateway, sleeps) as client, pytest.raises(InsufficientCredit) as info:
        _decide_sync(client)
    assert (info.value.code, info.value.retryable, info.value.status) == (
        "insufficient_credit",
        False,
        402,
    )
    assert sleeps.calls == []
    assert len(gateway.decide_requests()) == 1


def test_server_validation_error_is_typed(gateway: FakeGateway) -> None:
    bad = [{"id": "x", "question": "q?", "outcomes": [{"id": "a"}]}]
    with _sync(gateway, Sleeps()) as client, pytest.raises(TooFewOutcomes):
        client.decide(model="kettei-core", decisions=bad, text="t")  # type: ignore[arg-type]


def test_same_key_replays_and_other_body_conflicts(gateway: FakeGateway) -> None:
    with _sync(gateway, Sleeps()) as client:
        first = _decide_sync(client, idempotency_key="text-1-abc")
        again = _decide_sync(client, idempotency_key="text-1-abc")
        with pytest.raises(IdempotencyConflict):
            client.decide(
                model="kettei-core",
                decisions=DECISIONS,  # type: ignore[arg-type]
                text="another text",
                idempotency_key="text-1-abc",
            )
    assert first == again
    assert gateway.charges["text-1-abc"] == 1


def test_generated_keys_differ_between_calls(gateway: FakeGateway) -> None:
    with _sync(gateway, Sleeps()) as client:
        _decide_sync(client)
        _decide_sync(client)
    keys = [r.key for r in gateway.decide_requests()]
    assert len(set(keys)) == 2 and all(k and 8 <= len(k) <= 128 for k in keys)


def test_bad_key_is_not_retried(gateway: FakeGateway) -> None:
    sleeps = Sleeps()
    with Client(gateway.base_url, "wrong", clock=sleeps) as client, pytest.raises(InvalidApiKey):
        client.account()
    assert sleeps.calls == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_errors_back_off_with_jitter_then_raise() -> None:
    sleeps = Sleeps()
    url = f"http://127.0.0.1:{_closed_port()}"
    with Client(url, "k", clock=sleeps) as client, pytest.raises(ConnectionFailed) as info:
        client.decide(model="m", decisions=DECISIONS, text="t")  # type: ignore[arg-type]
    assert info.value.retryable is True
    assert len(sleeps.calls) == 2
    assert 0.25 <= sleeps.calls[0] <= 0.5 and 0.5 <= sleeps.calls[1] <= 1.0


async def test_async_client_retries_with_the_same_key(gateway: FakeGateway) -> None:
    sleeps = AsyncSleeps()
    gateway.fail_next(2, 429, "rate_limited", retry_after=2)
    async with AsyncClient(gateway.base_url, gateway.api_key, clock=sleeps) as client:
        answer = await client.decide(model="kettei-core", decisions=DECISIONS, text="hi")  # type: ignore[arg-type]
    assert answer["charge"]
    assert sleeps.calls == [2.0, 2.0]
    keys = {r.key for r in gateway.decide_requests()}
    assert len(keys) == 1


async def test_async_client_raises_typed_error_after_retries(gateway: FakeGateway) -> None:
    sleeps = AsyncSleeps()
    gateway.fail_next(3, 429, "rate_limited", retry_after=1)
    async with AsyncClient(gateway.base_url, gateway.api_key, clock=sleeps) as client:
        with pytest.raises(RateLimited) as info:
            await client.decide(model="kettei-core", decisions=DECISIONS, text="hi")  # type: ignore[arg-type]
    assert info.value.retry_after == 1.0
    assert len(gateway.decide_requests()) == 3


def test_retry_after_beyond_max_wait_is_not_waited() -> None:
    policy = RetryPolicy(max_wait=10)
    assert policy.delay(0, RateLimited("x", retry_after=11)) is None
    assert policy.delay(0, RateLimited("x", retry_after=10)) == 10


def test_error_without_wire_body_is_judged_by_status() -> None:
    error = error_from_response(httpx.Response(503, text="<html>bad gateway</html>"))
    assert error.retryable and error.status == 503
    assert not error_from_response(httpx.Response(400, text="nope")).retryable


def test_wire_body_keeps_code_param_and_extra_fields() -> None:
    body = {
        "error": {
            "code": "service_unavailable",
            "message": "busy",
            "retryable": True,
            "param": "model",
            "queue": 3,
        }
    }
    error = error_from_response(httpx.Response(503, json=body, headers={"Retry-After": "7"}))
    assert isinstance(error, ServiceUnavailable)
    assert (error.param, error.retry_after, error.details) == ("model", 7.0, {"queue": 3})


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHYARD_BASE_URL", "http://example.test:9/")
    monkeypatch.setenv("BATCHYARD_API_KEY", "sk-secret-value")
    client = Client()
    try:
        assert client.settings.base_url == "http://example.test:9"
        assert client.settings.api_key == "sk-secret-value"
        assert "sk-secret" not in repr(client) and "sk-secret" not in repr(client.settings)
    finally:
        client.close()


class SkipClock:
    """A clock whose sleeps pass at once but move its time, for the pacer."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.now += max(0.0, seconds)


async def test_a_429_on_a_paced_call_moves_the_shared_pace(gateway: FakeGateway) -> None:
    clock = SkipClock()
    pacer = Pacer(6000, clock=clock)
    gateway.fail_next(1, 429, "rate_limited", retry_after=2)
    async with AsyncClient(gateway.base_url, gateway.api_key, pacer=pacer) as client:
        await client.decide(model="kettei-core", decisions=DECISIONS, text="hi")  # type: ignore[arg-type]
        assert pacer.push_backs == 1
        # The wait happened once, in the pacer, where every other worker sees it.
        assert clock.calls == [pytest.approx(2.0)]
        await client.account()  # not a paced call: no wait
    assert clock.calls == [pytest.approx(2.0)]
    keys = {r.key for r in gateway.decide_requests()}
    assert len(keys) == 1


# The one retry step both clients take -----------------------------------------


def test_step_gives_up_on_errors_the_caller_must_fix_and_after_the_last_retry() -> None:
    policy = RetryPolicy(max_retries=2)
    assert policy.step(0, InvalidApiKey("x")) is None
    assert policy.step(2, RateLimited("x", retry_after=1)) is None


def test_step_numbers_the_retry_and_lets_an_unpaced_call_sleep_the_wait() -> None:
    step = RetryPolicy().step(1, RateLimited("x", retry_after=3))
    assert step == RetryStep(attempt=2, delay=3.0, pacer=False, slow=False)


def test_step_hands_a_paced_429_to_the_pacer_and_slows_only_for_a_long_wait() -> None:
    policy = RetryPolicy()
    # Half a slot or more: someone else uses the limit, so the pace slows.
    shared = policy.step(0, RateLimited("x", retry_after=0.5), slot=1.0)
    assert shared == RetryStep(attempt=1, delay=0.5, pacer=True, slow=True)
    # Under half a slot: timing noise, held but not slowed.
    noise = policy.step(0, RateLimited("x", retry_after=0.2), slot=1.0)
    assert noise == RetryStep(attempt=1, delay=0.2, pacer=True, slow=False)


def test_step_sleeps_other_errors_of_a_paced_call_outside_the_pacer() -> None:
    step = RetryPolicy().step(0, ServiceUnavailable("x", retry_after=2), slot=1.0)
    assert step is not None and (step.pacer, step.delay) == (False, 2.0)


class SyncSkipClock:
    """SkipClock for the sync client: sleeps pass at once but move its time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.now += max(0.0, seconds)


def test_a_429_on_a_paced_call_moves_the_shared_pace_of_the_sync_client(
    gateway: FakeGateway,
) -> None:
    clock = SyncSkipClock()
    pacer = SyncPacer(6000, clock=clock)
    gateway.fail_next(1, 429, "rate_limited", retry_after=2)
    with Client(gateway.base_url, gateway.api_key, pacer=pacer) as client:
        _decide_sync(client, tokens=10)
        assert pacer.push_backs == 1
        assert clock.calls == [pytest.approx(2.0)]
        client.account()  # not a paced call: no wait
    assert clock.calls == [pytest.approx(2.0)]
    assert len({r.key for r in gateway.decide_requests()}) == 1


def test_with_pacer_shares_the_connection_and_paces_only_the_view(gateway: FakeGateway) -> None:
    clock = SyncSkipClock()
    with Client(gateway.base_url, gateway.api_key) as client:
        paced = client.with_pacer(SyncPacer(60, headroom=1.0, clock=clock))
        for _ in range(3):
            _decide_sync(paced)
        _decide_sync(client)
    # One second apart from the first send on; the plain client never waited.
    assert clock.calls == [pytest.approx(1.0), pytest.approx(1.0)]
    assert client.pacer is None
