"""An in-memory engine with scripted answers, failures and delays.

The dispatcher's retry, pacing and billing rules, and the front doors that
sit on them, need an engine whose every answer and failure is chosen by the
test; a real model makes those tests slow and their outcomes uncertain. It is
shipped, not test-only, so demos and the service's own self-checks can run
without a model.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.tokens import message_text
from batchyard.engines.protocol import (
    Choice,
    Completion,
    CompletionRequest,
    Delta,
    Embeddings,
    RateLimitSignal,
    Usage,
)

__all__ = ["ScoreCall", "ScriptedEngine", "word_count"]

Script = str | Callable[[CompletionRequest], str]
Scorer = Callable[[str, list[dict[str, Any]], list[str]], list[float]]


def word_count(text: str) -> int:
    """The scripted engine's notion of a token: a whitespace-separated word."""
    return len(text.split())


@dataclass(frozen=True, slots=True)
class ScoreCall:
    model: str
    messages: list[dict[str, Any]]
    candidates: list[str]


def _prompt_words(messages: list[dict[str, Any]]) -> int:
    return sum(word_count(message_text(m.get("content"))[0]) for m in messages)


def _default_scores(
    model: str, messages: list[dict[str, Any]], candidates: list[str]
) -> list[float]:
    """Favour a candidate the last user message mentions, so tests can steer decisions."""
    last_user = next(
        (message_text(m.get("content"))[0] for m in reversed(messages) if m.get("role") == "user"),
        "",
    ).lower()
    return [math.log(0.9) if c.lower() in last_user else -5.0 - 0.01 * len(c) for c in candidates]


class ScriptedEngine:
    """Answers from a script: fixed text or a function of the request.

    Usage counts words (prompt words in, answer words out), so tests can
    predict billing exactly. ``failures`` are raised one per call, in order,
    before answers resume; a ``None`` in the list lets that call succeed.
    Delays wait on the injected clock, so a ``ManualClock`` controls them.
    """

    def __init__(
        self,
        answer: Script = "ok",
        *,
        name: str = "scripted",
        failures: Iterable[BaseException | None] = (),
        delay_s: float = 0.0,
        clock: Clock | None = None,
        scorer: Scorer | None = None,
        rate_limit: RateLimitSignal | None = None,
    ) -> None:
        self.name = name
        self.answer = answer
        self.delay_s = delay_s
        self.clock: Clock = clock or SystemClock()
        self.scorer: Scorer = scorer or _default_scores
        self.rate_limit = rate_limit
        self._failures: deque[BaseException | None] = deque(failures)
        self.calls: list[CompletionRequest] = []
        self.score_calls: list[ScoreCall] = []
        self.embed_calls: list[list[str]] = []
        self.stream_delay_s = 0.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False

    def fail_next(self, *errors: BaseException | None) -> None:
        """Queue more failures behind any already scripted."""
        self._failures.extend(errors)

    @property
    def pending_failures(self) -> int:
        return len(self._failures)

    async def _enter(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s > 0:
                await self.clock.sleep(self.delay_s)
            if self._failures:
                failure = self._failures.popleft()
                if failure is not None:
                    raise failure
        except BaseException:
            self.in_flight -= 1
            raise

    def _text_for(self, request: CompletionRequest) -> str:
        return self.answer(request) if callable(self.answer) else self.answer

    async def complete(self, request: CompletionRequest) -> Completion:
        self.calls.append(request)
        await self._enter()
        try:
            choices: list[Choice] = []
            output = 0
            for _ in range(max(1, request.n)):
                text = self._text_for(request)
                words = text.split()
                finish = "stop"
                if len(words) > request.max_tokens:
                    words, finish = words[: request.max_tokens], "length"
                    text = " ".join(words)
                output += len(words)
                logprobs = (
                    [{"token": w, "logprob": -0.1, "bytes": list(w.encode())} for w in words]
                    if request.logprobs
                    else None
                )
                choices.append(Choice(text=text, finish_reason=finish, logprobs=logprobs))
            usage = Usage(input_tokens=_prompt_words(request.messages), output_tokens=output)
            return Completion(
                model=request.model, choices=choices, usage=usage, rate_limit=self.rate_limit
            )
        finally:
            self.in_flight -= 1

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        """The scripted answer word by word (``stream_delay_s`` of clock time between words)."""
        done = await self.complete(request)
        for i, choice in enumerate(done.choices):
            words = choice.text.split(" ")
            for k, word in enumerate(words):
                if self.stream_delay_s > 0 and k:
                    await self.clock.sleep(self.stream_delay_s)
                yield Delta(i, word if k == 0 else " " + word)
            yield Delta(i, "", choice.tool_calls, None, choice.finish_reason)
        yield done

    async def embed(self, model: str, texts: list[str]) -> Embeddings:
        """Eight numbers a text, from its hash: the same text always gets the same vector."""
        self.embed_calls.append(list(texts))
        await self._enter()
        try:
            vectors = []
            for text in texts:
                digest = hashlib.sha256(text.encode()).digest()
                raw = [b / 255.0 - 0.5 for b in digest[:8]]
                norm = math.sqrt(sum(x * x for x in raw)) or 1.0
                vectors.append([x / norm for x in raw])
            return Embeddings(vectors, Usage(sum(word_count(t) for t in texts), 0))
        finally:
            self.in_flight -= 1

    async def score(
        self, model: str, messages: list[dict[str, Any]], candidates: list[str]
    ) -> tuple[list[float], Usage]:
        """Scores from ``scorer``; output usage is the sum of candidate words, as evaluated."""
        self.score_calls.append(ScoreCall(model, messages, list(candidates)))
        await self._enter()
        try:
            scores = self.scorer(model, messages, candidates)
            usage = Usage(
                input_tokens=_prompt_words(messages),
                output_tokens=sum(word_count(c) for c in candidates),
            )
            return scores, usage
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        self.closed = True
