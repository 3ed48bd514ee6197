"""The HTTP engine against a real fake upstream: answers, limits and every failure mode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import aiohttp
import httpx
import pytest

from batchyard.core.clock import ManualClock
from batchyard.engines.openai_http import (
    OpenAIHttpEngine,
    parse_rate_limit,
    parse_reset,
    parse_retry_after,
    rate_limit_of,
)
from batchyard.engines.protocol import (
    Completion,
    CompletionRequest,
    Engine,
    RateLimitSignal,
    Usage,
)
from batchyard.errors import (
    UpstreamError,
    UpstreamRateLimited,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from tests.support.fake_upstream import FakeUpstream


def request(text: str = "hello there", **options: object) -> CompletionRequest:
    messages = [{"role": "user", "content": text}]
    return CompletionRequest("gpt-fake", messages, 16, **options)  # type: ignore[arg-type]


@pytest.fixture
def up() -> Iterator[FakeUpstream]:
    with FakeUpstream(time_fn=lambda: 50.5) as server:
        yield server


@pytest.fixture
async def engine(up: FakeUpstream) -> AsyncIterator[OpenAIHttpEngine]:
    eng = OpenAIHttpEngine(up.base_url, "sk-secret", timeout_s=2.0)
    yield eng
    await eng.aclose()


async def test_success_parses_choices_usage_and_sends_the_key(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    assert isinstance(engine, Engine)
    done = await engine.complete(request(n=2, seed=7, temperature=0.5, stop=["\n"]))
    assert [c.text for c in done.choices] == ["echo: hello there"] * 2
    assert done.usage.input_tokens == 2 and done.usage.output_tokens == 6
    assert done.model == "gpt-fake"
    assert done.rate_limit is None
    assert up.last_headers["authorization"] == "Bearer sk-secret"
    sent = up.last_request or {}
    assert (sent["n"], sent["seed"], sent["temperature"], sent["stop"]) == (2, 7, 0.5, ["\n"])
    assert "top_p" not in sent and "logprobs" not in sent


async def test_image_parts_and_response_format_pass_through(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    content = [
        {"type": "text", "text": "what is this"},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
        },
    ]
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema, "strict": True}}
    done = await engine.complete(
        CompletionRequest(
            model="vision",
            messages=[{"role": "user", "content": content}],
            max_tokens=9,
            response_format=fmt,
        )
    )
    assert (up.last_request or {})["messages"][0]["content"] == content
    assert (up.last_request or {})["response_format"] == fmt
    assert done.text == '{"kind": "cat"}'


async def test_logprobs_are_requested_and_parsed(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    done = await engine.complete(request(logprobs=True, top_logprobs=2))
    assert (up.last_request or {})["top_logprobs"] == 2
    assert [lp["token"] for lp in done.choices[0].logprobs or []] == ["echo:", "hello", "there"]


async def test_rate_limit_headers_are_read_on_success(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    up.rpm = 300
    done = await engine.complete(request())
    assert done.rate_limit == RateLimitSignal(
        remaining_requests=4, reset_requests_s=0.5, limit_requests=300
    )


async def test_429_carries_retry_after_and_the_signal(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    up.rpm = 60
    await engine.complete(request())
    with pytest.raises(UpstreamRateLimited) as caught:
        await engine.complete(request())
    err = caught.value
    assert err.retryable and err.code == "upstream_rate_limited"
    assert err.retry_after == pytest.approx(0.5)  # retry-after-ms beats the rounded header
    signal = rate_limit_of(err)
    assert signal is not None and signal.remaining_requests == 0
    assert signal.reset_requests_s == pytest.approx(0.5)


async def test_scripted_429_with_plain_retry_after(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    up.fail_next(1, status=429, retry_after=3)
    with pytest.raises(UpstreamRateLimited) as caught:
        await engine.complete(request())
    assert caught.value.retry_after == 3.0
    assert rate_limit_of(caught.value) is None


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_is_retryable(up: FakeUpstream, engine: OpenAIHttpEngine, status: int) -> None:
    up.fail_next(1, status=status, retry_after=2)
    with pytest.raises(UpstreamError) as caught:
        await engine.complete(request())
    assert type(caught.value) is UpstreamError
    assert caught.value.retryable and caught.value.code == "upstream_error"
    assert caught.value.retry_after == 2.0
    assert (await engine.complete(request())).text == "echo: hello there"


async def test_4xx_is_rejected_not_retried(engine: OpenAIHttpEngine) -> None:
    with FakeUpstream(api_key="other") as strict:
        eng = OpenAIHttpEngine(strict.base_url, "sk-wrong")
        with pytest.raises(UpstreamError) as caught:
            await eng.complete(request())
        await eng.aclose()
    err = caught.value
    assert (err.code, err.status, err.retryable) == ("upstream_rejected", 502, False)
    assert "bad key" in err.message
    assert "sk-wrong" not in err.message


async def test_timeout_maps_to_upstream_timeout(up: FakeUpstream) -> None:
    up.delay_s = 1.0
    eng = OpenAIHttpEngine(up.base_url, timeout_s=0.2)
    with pytest.raises(UpstreamTimeout) as caught:
        await eng.complete(request())
    assert caught.value.retryable and caught.value.status == 504
    await eng.aclose()


async def test_connection_refused_is_a_retryable_upstream_unreachable() -> None:
    with FakeUpstream() as gone:
        url = gone.base_url
    eng = OpenAIHttpEngine(url, timeout_s=1.0)
    with pytest.raises(UpstreamUnreachable) as caught:
        await eng.complete(request())
    assert caught.value.code == "upstream_unreachable" and caught.value.retryable
    await eng.aclose()


@pytest.mark.parametrize("kind", ["invalid_json", "missing_usage"])
async def test_malformed_bodies(up: FakeUpstream, engine: OpenAIHttpEngine, kind: str) -> None:
    up.malformed_next(1, kind=kind)
    with pytest.raises(UpstreamError) as caught:
        await engine.complete(request())
    assert caught.value.code == "upstream_malformed"


async def test_injected_session_is_used_and_left_open(up: FakeUpstream) -> None:
    async with aiohttp.ClientSession() as session:
        eng = OpenAIHttpEngine(up.base_url, "k", session=session)
        assert (await eng.complete(request())).text == "echo: hello there"
        await eng.aclose()
        assert not session.closed
    assert up.last_headers["authorization"] == "Bearer k"


def test_reset_formats() -> None:
    assert parse_reset("1s") == 1.0
    assert parse_reset("6m0s") == 360.0
    assert parse_reset("20ms") == pytest.approx(0.02)
    assert parse_reset("1h2m3.5s") == pytest.approx(3723.5)
    assert parse_reset("2.5") == 2.5
    assert parse_reset("soon") is None
    assert parse_reset("5x") is None
    assert parse_reset(None) is None


def test_retry_after_as_http_date() -> None:
    clock = ManualClock(datetime(2026, 3, 1, 12, 0, tzinfo=UTC))
    later = format_datetime(clock.now() + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(httpx.Headers({"retry-after": later}), clock) == 30.0
    assert parse_retry_after(httpx.Headers({"retry-after": "nonsense"}), clock) is None


def test_token_limits_parse() -> None:
    signal = parse_rate_limit(
        httpx.Headers(
            {
                "x-ratelimit-limit-tokens": "40000",
                "x-ratelimit-remaining-tokens": "39000",
                "x-ratelimit-reset-tokens": "1m30s",
            }
        )
    )
    assert signal == RateLimitSignal(
        remaining_tokens=39000, reset_tokens_s=90.0, limit_tokens=40000
    )
    assert parse_rate_limit(httpx.Headers({})) is None


async def test_the_upstreams_cached_prompt_tokens_are_read_streamed_or_not() -> None:
    with FakeUpstream(prompt_cache=True) as up:
        eng = OpenAIHttpEngine(up.base_url, "k")
        first = await eng.complete(request("the same long opening and then one"))
        second = await eng.complete(request("the same long opening and then two"))
        streamed = [
            part
            async for part in eng.stream(
                request("the same long opening but three", stream_usage=True)
            )
        ]
        await eng.aclose()
    assert first.usage == Usage(7, 8, 0)
    assert second.usage == Usage(7, 8, 6)
    done = streamed[-1]
    assert isinstance(done, Completion) and done.usage == Usage(6, 7, 4)


async def test_a_streams_mistyped_usage_counts_as_none(
    up: FakeUpstream, engine: OpenAIHttpEngine
) -> None:
    """The answer went out piece by piece; the gateway counts it instead of failing at the end."""
    up.malformed_next(1, kind="mistyped_stream_usage")
    parts = [part async for part in engine.stream(request(stream_usage=True))]
    done = parts[-1]
    assert isinstance(done, Completion)
    assert done.text == "hi" and done.usage == Usage(0, 0)
    assert done.raw == {"usage_missing": True}
