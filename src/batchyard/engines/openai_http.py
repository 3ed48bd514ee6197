"""An engine that forwards to any OpenAI-compatible ``/chat/completions``.

Every failure is mapped onto the error tree so the dispatcher decides retries
from ``retryable`` and ``retry_after`` alone, and the upstream's own
``x-ratelimit-*`` headers ride along (on completions and on the raised error,
as ``rate_limit``) so pacing follows what the provider says rather than a
guess. The hot path is one pooled client and one ``json`` round trip per call:
this engine is benchmarked against a bare httpx loop.

The transport is aiohttp rather than httpx: measured on loopback against an
instant upstream, one call costs about 0.25 ms of CPU through aiohttp and
2.8 ms through httpx, and the gateway's whole budget per call is a few ms.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Mapping
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from batchyard.core.clock import Clock, SystemClock
from batchyard.engines.protocol import (
    Choice,
    Completion,
    CompletionRequest,
    Delta,
    Embeddings,
    RateLimitSignal,
    Usage,
)
from batchyard.errors import (
    UpstreamError,
    UpstreamRateLimited,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = [
    "OpenAIHttpEngine",
    "parse_rate_limit",
    "parse_reset",
    "parse_retry_after",
    "rate_limit_of",
    "read_usage",
]

log = logging.getLogger(__name__)

# Attribute name under which raised errors carry the upstream's RateLimitSignal.
RATE_LIMIT_ATTR = "rate_limit"

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


def parse_reset(value: str | None) -> float | None:
    """Seconds from OpenAI's reset format (``1s``, ``6m0s``, ``20ms``) or plain seconds."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    total, pos = 0.0, 0
    for match in _DURATION_PART.finditer(value):
        if match.start() != pos:
            return None
        number, unit = float(match.group(1)), match.group(2)
        total += number * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]
        pos = match.end()
    return total if pos == len(value) and pos > 0 else None


def _int_header(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_rate_limit(headers: Mapping[str, str]) -> RateLimitSignal | None:
    """The ``x-ratelimit-*`` headers as a signal; ``None`` where the upstream sends none."""
    get = headers.get
    limit_req = get("x-ratelimit-limit-requests")
    remaining_req = get("x-ratelimit-remaining-requests")
    reset_req = get("x-ratelimit-reset-requests")
    limit_tok = get("x-ratelimit-limit-tokens")
    remaining_tok = get("x-ratelimit-remaining-tokens")
    reset_tok = get("x-ratelimit-reset-tokens")
    if (
        limit_req is None
        and remaining_req is None
        and reset_req is None
        and limit_tok is None
        and remaining_tok is None
        and reset_tok is None
    ):
        return None
    return RateLimitSignal(
        remaining_requests=_int_header(remaining_req),
        remaining_tokens=_int_header(remaining_tok),
        reset_requests_s=parse_reset(reset_req),
        reset_tokens_s=parse_reset(reset_tok),
        limit_requests=_int_header(limit_req),
        limit_tokens=_int_header(limit_tok),
    )


def parse_retry_after(headers: Mapping[str, str], clock: Clock) -> float | None:
    """How long the upstream asked us to wait, from the most precise header it sent."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is not None:
        value = value.strip()
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - clock.time())
    return None


def rate_limit_of(error: BaseException) -> RateLimitSignal | None:
    """The upstream's rate-limit signal carried by an error this engine raised."""
    signal = getattr(error, RATE_LIMIT_ATTR, None)
    return signal if isinstance(signal, RateLimitSignal) else None


def _upstream_message(content: bytes, reason: str | None) -> str:
    try:
        body = json.loads(content)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    except ValueError:
        pass
    return content[:200].decode("utf-8", "replace") or (reason or "")


def read_usage(usage: Mapping[str, Any]) -> Usage:
    """An OpenAI ``usage`` object as ``Usage``, the prompt tokens its cache served included.

    OpenAI (and vLLM, llama.cpp's server, most compatible servers) say in
    ``prompt_tokens_details.cached_tokens`` how many prompt tokens came from
    the upstream's prompt cache; a route's ``cached_input_per_mtok`` prices
    them. An odd count is cut to the prompt (none below zero, none above the
    prompt's tokens), so no upstream makes a call cost less than its prompt
    read wholly from a cache. Raises ``KeyError``, ``TypeError`` or
    ``ValueError`` for a missing or mistyped count.
    """
    input_tokens = int(usage["prompt_tokens"])
    output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, Mapping) else 0
    return Usage(input_tokens, output_tokens, min(max(cached, 0), max(input_tokens, 0)))


def _malformed(detail: str) -> UpstreamError:
    return UpstreamError(f"upstream answered malformed JSON: {detail}", code="upstream_malformed")


class OpenAIHttpEngine:
    """Chat completions over HTTP against an OpenAI-compatible base URL (ending in ``/v1``)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 60.0,
        name: str = "openai_http",
        session: aiohttp.ClientSession | None = None,
        max_connections: int = 256,
        clock: Clock | None = None,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self._url = f"{self.base_url}/chat/completions"
        self._text_url = f"{self.base_url}/completions"
        self._embeddings_url = f"{self.base_url}/embeddings"
        self._clock: Clock = clock or SystemClock()
        self._headers = {"content-type": "application/json", "accept": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._owns_session = session is None
        self._session = session

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use, inside the event loop that will run it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=self._timeout,
            )
            self._owns_session = True
        return self._session

    @staticmethod
    def body_for(request: CompletionRequest) -> dict[str, Any]:
        """OpenAI's request body; messages go through untouched, image parts included."""
        body: dict[str, Any] = {"model": request.model, "max_tokens": request.max_tokens}
        if request.prompt is not None:
            body["prompt"] = request.prompt
        else:
            body["messages"] = request.messages
        if request.n != 1:
            body["n"] = request.n
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.top_p is not None:
            body["top_p"] = request.top_p
        if request.top_k is not None:  # not OpenAI's; vLLM and llama.cpp's server read it
            body["top_k"] = request.top_k
        if request.stop:
            body["stop"] = request.stop
        if request.seed is not None:
            body["seed"] = request.seed
        if request.response_format is not None:
            body["response_format"] = request.response_format
        if request.logprobs:
            if request.prompt is not None:
                body["logprobs"] = request.top_logprobs or 0
            else:
                body["logprobs"] = True
                if request.top_logprobs is not None:
                    body["top_logprobs"] = request.top_logprobs
        if request.tools:
            body["tools"] = request.tools
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
        if request.frequency_penalty is not None:
            body["frequency_penalty"] = request.frequency_penalty
        if request.presence_penalty is not None:
            body["presence_penalty"] = request.presence_penalty
        return body

    def _url_for(self, request: CompletionRequest) -> str:
        return self._text_url if request.prompt is not None else self._url

    async def complete(self, request: CompletionRequest) -> Completion:
        payload = json.dumps(self.body_for(request), separators=(",", ":")).encode()
        try:
            async with self._client().post(
                self._url_for(request), data=payload, headers=self._headers, timeout=self._timeout
            ) as response:
                status = response.status
                headers = response.headers
                content = await response.read()
                reason = response.reason
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream timed out ({type(exc).__name__})") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(f"upstream unreachable ({type(exc).__name__})") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream unreachable ({type(exc).__name__})") from None
        signal = parse_rate_limit(headers)
        if status != 200:
            raise self._error_for(status, headers, content, reason, signal)
        try:
            data = json.loads(content)
        except ValueError:
            raise _malformed("body is not JSON") from None
        return self._completion(data, request, signal)

    def _error_for(
        self,
        status: int,
        headers: Mapping[str, str],
        content: bytes,
        reason: str | None,
        signal: RateLimitSignal | None,
    ) -> UpstreamError:
        retry_after = parse_retry_after(headers, self._clock)
        message = _upstream_message(content, reason)
        error: UpstreamError
        if status == 429:
            if retry_after is None and signal is not None:
                resets = [r for r in (signal.reset_requests_s, signal.reset_tokens_s) if r]
                retry_after = max(resets) if resets else None
            error = UpstreamRateLimited(
                f"upstream rate limited: {message}", retry_after=retry_after
            )
        elif status >= 500:
            error = UpstreamError(
                f"upstream failed with HTTP {status}: {message}",
                retry_after=retry_after,
                # 503 says the server is not handling requests: it took nothing.
                not_taken=status == 503,
            )
        else:
            error = UpstreamError(
                f"upstream rejected the request (HTTP {status}): {message}",
                code="upstream_rejected",
                status=502,
                retryable=False,
            )
        log.info(
            "upstream error",
            extra={"engine": self.name, "http_status": status, "retry_after": retry_after},
        )
        setattr(error, RATE_LIMIT_ATTR, signal)
        return error

    @staticmethod
    def _completion(
        data: Any, request: CompletionRequest, signal: RateLimitSignal | None
    ) -> Completion:
        if not isinstance(data, dict):
            raise _malformed("body is not an object")
        usage = data.get("usage")
        if not isinstance(usage, dict):
            raise _malformed("no usage; the call cannot be billed")
        raw_choices = data.get("choices")
        if not isinstance(raw_choices, list) or not raw_choices:
            raise _malformed("no choices")
        try:
            used = read_usage(usage)
            if len(raw_choices) > 1:
                raw_choices = sorted(raw_choices, key=lambda c: c.get("index", 0))
            choices = []
            for raw in raw_choices:
                message = raw.get("message") or {}
                logprobs = raw.get("logprobs")
                text = raw.get("text") if request.prompt is not None else message.get("content")
                choices.append(
                    Choice(
                        text=text or "",
                        finish_reason=raw.get("finish_reason") or "stop",
                        logprobs=logprobs.get("content") if isinstance(logprobs, dict) else None,
                        tool_calls=message.get("tool_calls") or None,
                    )
                )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise _malformed("missing or mistyped fields") from None
        return Completion(
            model=data.get("model") or request.model,
            choices=choices,
            usage=used,
            rate_limit=signal,
            raw=data,
        )

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        """The upstream's own stream, piece by piece, then the whole answer and its usage.

        Usage is asked for (``stream_options.include_usage``); an upstream that
        sends none ends with a ``Completion`` whose ``raw`` says
        ``usage_missing``, and the dispatcher counts the text itself.
        """
        body = self.body_for(request)
        body["stream"] = True
        if request.stream_usage:
            body["stream_options"] = {"include_usage": True}
        payload = json.dumps(body, separators=(",", ":")).encode()
        texts: dict[int, list[str]] = {}
        finishes: dict[int, str] = {}
        calls: dict[int, list[dict[str, Any]]] = {}
        usage: dict[str, Any] | None = None
        headers = {**self._headers, "accept": "text/event-stream"}
        try:
            async with self._client().post(
                self._url_for(request), data=payload, headers=headers, timeout=self._timeout
            ) as response:
                signal = parse_rate_limit(response.headers)
                if response.status != 200:
                    content = await response.read()
                    raise self._error_for(
                        response.status, response.headers, content, response.reason, signal
                    )
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise _malformed("a stream event is not JSON") from None
                    if isinstance(chunk.get("usage"), dict):
                        usage = chunk["usage"]
                    for raw in chunk.get("choices") or []:
                        index = int(raw.get("index", 0))
                        delta = raw.get("delta") or {}
                        piece = raw.get("text") if request.prompt is not None else None
                        if request.prompt is None:
                            piece = delta.get("content")
                        if piece:
                            texts.setdefault(index, []).append(piece)
                        if delta.get("tool_calls"):
                            calls.setdefault(index, []).extend(delta["tool_calls"])
                        if raw.get("finish_reason"):
                            finishes[index] = raw["finish_reason"]
                        logprobs = raw.get("logprobs")
                        yield Delta(
                            index,
                            piece or "",
                            delta.get("tool_calls") or None,
                            logprobs.get("content") if isinstance(logprobs, dict) else None,
                            raw.get("finish_reason"),
                        )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream timed out ({type(exc).__name__})") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(f"upstream unreachable ({type(exc).__name__})") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream unreachable ({type(exc).__name__})") from None
        indexes = sorted(set(texts) | set(finishes) | set(calls)) or [0]
        choices = [
            Choice(
                text="".join(texts.get(i, [])),
                finish_reason=finishes.get(i, "stop"),
                tool_calls=_merge_tool_calls(calls[i]) if i in calls else None,
            )
            for i in indexes
        ]
        raw_info: dict[str, Any] = {}
        used = Usage(0, 0)
        try:
            if usage is not None:
                used = read_usage(usage)
        except (KeyError, TypeError, ValueError, AttributeError):
            usage = None  # the answer is out already: count it as an upstream that sent none
        if usage is None:
            raw_info["usage_missing"] = True
        yield Completion(request.model, choices, used, rate_limit=signal, raw=raw_info)

    async def embed(self, model: str, texts: list[str]) -> Embeddings:
        payload = json.dumps({"model": model, "input": texts}).encode()
        try:
            async with self._client().post(
                self._embeddings_url, data=payload, headers=self._headers, timeout=self._timeout
            ) as response:
                status, headers = response.status, response.headers
                content = await response.read()
                reason = response.reason
        except TimeoutError as exc:
            raise UpstreamTimeout(f"upstream timed out ({type(exc).__name__})") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnreachable(f"upstream unreachable ({type(exc).__name__})") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream unreachable ({type(exc).__name__})") from None
        if status != 200:
            raise self._error_for(status, headers, content, reason, parse_rate_limit(headers))
        try:
            data = json.loads(content)
            rows = sorted(data["data"], key=lambda r: r.get("index", 0))
            vectors = [[float(x) for x in r["embedding"]] for r in rows]
            tokens = int((data.get("usage") or {}).get("prompt_tokens") or 0)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise _malformed("not an embeddings list") from None
        if len(vectors) != len(texts):
            raise _malformed("a different number of embeddings than inputs")
        return Embeddings(vectors, Usage(tokens, 0))

    async def aclose(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None


def _merge_tool_calls(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole tool calls from a stream's pieces (arguments arrive in fragments, by index)."""
    merged: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        index = int(piece.get("index", 0))
        call = merged.setdefault(
            index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if piece.get("id"):
            call["id"] = piece["id"]
        fn = piece.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [merged[i] for i in sorted(merged)]
