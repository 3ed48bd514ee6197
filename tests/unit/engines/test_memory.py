"""The scripted engine does exactly what its script says, and counts words as tokens."""

from __future__ import annotations

import asyncio

import pytest

from batchyard.core.clock import ManualClock
from batchyard.engines.protocol import CompletionRequest, Engine, RateLimitSignal, ScoringEngine
from batchyard.engines.scripted import ScriptedEngine, word_count
from batchyard.errors import UpstreamError, UpstreamRateLimited
from tests.support.waits import settles


def request(
    text: str = "one two three", *, max_tokens: int = 50, n: int = 1, logprobs: bool = False
) -> CompletionRequest:
    return CompletionRequest(
        model="m",
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        n=n,
        logprobs=logprobs,
    )


def test_it_is_an_engine_and_a_scoring_engine() -> None:
    engine = ScriptedEngine()
    assert isinstance(engine, Engine)
    assert isinstance(engine, ScoringEngine)


async def test_fixed_answer_with_word_count_usage() -> None:
    engine = ScriptedEngine("the answer is four")
    done = await engine.complete(request("what is two plus two"))
    assert done.text == "the answer is four"
    assert done.usage.input_tokens == 5
    assert done.usage.output_tokens == 4
    assert done.choices[0].finish_reason == "stop"
    assert engine.calls[0].messages[0]["content"] == "what is two plus two"


async def test_callable_answer_sees_the_request_and_n_gives_choices() -> None:
    engine = ScriptedEngine(lambda r: r.messages[-1]["content"].upper())
    done = await engine.complete(request("hello there", n=3))
    assert [c.text for c in done.choices] == ["HELLO THERE"] * 3
    assert done.usage.output_tokens == 6


async def test_image_parts_count_only_their_text() -> None:
    engine = ScriptedEngine("ok")
    content = [
        {"type": "text", "text": "describe this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    done = await engine.complete(
        CompletionRequest(model="m", messages=[{"role": "user", "content": content}], max_tokens=5)
    )
    assert done.usage.input_tokens == 2


async def test_max_tokens_truncates_and_reports_length() -> None:
    engine = ScriptedEngine("a b c d e f")
    done = await engine.complete(request(max_tokens=2, logprobs=True))
    assert done.text == "a b"
    assert done.choices[0].finish_reason == "length"
    assert done.usage.output_tokens == 2
    assert [lp["token"] for lp in done.choices[0].logprobs or []] == ["a", "b"]


async def test_failures_are_raised_in_order_then_answers_resume() -> None:
    limited = UpstreamRateLimited("slow down", retry_after=2.0)
    broken = UpstreamError("boom")
    engine = ScriptedEngine("fine", failures=[limited, None, broken])
    with pytest.raises(UpstreamRateLimited) as first:
        await engine.complete(request())
    assert first.value.retry_after == 2.0
    assert (await engine.complete(request())).text == "fine"
    with pytest.raises(UpstreamError):
        await engine.complete(request())
    assert (await engine.complete(request())).text == "fine"
    assert len(engine.calls) == 4
    assert engine.pending_failures == 0
    engine.fail_next(broken)
    assert engine.pending_failures == 1
    with pytest.raises(UpstreamError):
        await engine.complete(request())
    assert engine.in_flight == 0


async def test_delay_waits_on_the_injected_clock() -> None:
    clock = ManualClock()
    engine = ScriptedEngine("late", delay_s=5.0, clock=clock)
    task = asyncio.create_task(engine.complete(request()))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not task.done()
    assert engine.in_flight == 1
    clock.advance(4.9)
    await asyncio.sleep(0)
    assert not task.done()
    clock.advance(0.2)
    done = await settles(task)
    assert done.text == "late"
    assert engine.max_in_flight == 1
    assert engine.in_flight == 0


async def test_rate_limit_signal_rides_on_completions() -> None:
    signal = RateLimitSignal(remaining_requests=3, reset_requests_s=1.0)
    engine = ScriptedEngine(rate_limit=signal)
    assert (await engine.complete(request())).rate_limit == signal


async def test_default_scores_favour_a_candidate_the_user_mentions() -> None:
    engine = ScriptedEngine()
    messages = [{"role": "user", "content": "This is clearly Spam, buy now"}]
    scores, usage = await engine.score("m", messages, ["ham", "spam"])
    assert scores[1] > scores[0]
    assert usage.input_tokens == word_count("This is clearly Spam, buy now")
    assert usage.output_tokens == 2
    assert engine.score_calls[0].candidates == ["ham", "spam"]


async def test_custom_scorer_and_scripted_failure_on_score() -> None:
    engine = ScriptedEngine(scorer=lambda model, msgs, cands: [float(len(c)) for c in cands])
    scores, _ = await engine.score("m", [{"role": "user", "content": "x"}], ["a", "bbb"])
    assert scores == [1.0, 3.0]
    engine.fail_next(UpstreamError("nope"))
    with pytest.raises(UpstreamError):
        await engine.score("m", [{"role": "user", "content": "x"}], ["a"])


async def test_aclose_marks_closed() -> None:
    engine = ScriptedEngine()
    await engine.aclose()
    assert engine.closed
