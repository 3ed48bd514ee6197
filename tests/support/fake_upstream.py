"""A real HTTP server that speaks OpenAI's chat completions, with faults on demand.

Fault and load tests (and bench/) need an upstream that rate-limits like a
hosted provider, fails when told, stalls, answers garbage, and warms models
up, over real sockets so the engine's HTTP handling is what gets tested. It is
a raw asyncio protocol on its own thread and loop (no framework in the hot
path), so "instant" mode serves thousands of requests per second on one core.

Knobs are plain attributes and methods, safe to change while it runs::

    with FakeUpstream(rpm=600) as up:
        engine = OpenAIHttpEngine(up.base_url)
        up.fail_next(2, status=503, retry_after=1)

Time for the per-second limiter comes from ``time_fn`` (``time.monotonic`` by
default) so a test can pin the window instead of racing the wall clock.

Fault tests need to know what really reached the provider, and to catch a
caller with its calls in flight (echo mode): ``hold(after=n)`` answers ``n``
more calls and then keeps every later one open until ``release()``;
``arrived`` and ``answered`` list the last user text of each call that got
past faults and limits, and ``abandoned`` counts held calls whose caller hung
up (a worker that died mid-call)::

    up.hold(after=5)      # 5 answers, then calls stay in flight
    ...                   # wait until len(up.arrived) == 7, kill the caller
    up.release()          # answer whatever is still held; stop holding
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

from tests.support.waits import HANG_S

__all__ = ["FakeUpstream"]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

_INSTANT_BODY = json.dumps(
    {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "model": "fake",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    },
    separators=(",", ":"),
).encode()


def _response(
    status: int,
    body: bytes,
    headers: list[tuple[str, str]] | None = None,
    content_type: str = "application/json",
) -> bytes:
    head = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}",
        f"content-type: {content_type}",
        f"content-length: {len(body)}",
    ]
    if headers:
        head.extend(f"{k}: {v}" for k, v in headers)
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


_INSTANT_RESPONSE = _response(200, _INSTANT_BODY)


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": code, "code": code}}).encode()


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _last_user_text(request: dict[str, Any]) -> str:
    messages = request.get("messages") or []
    return next(
        (
            _text_of(m.get("content"))
            for m in reversed(messages)
            if isinstance(m, dict) and m.get("role") == "user"
        ),
        "",
    )


def _shared_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _value_for(schema: Any) -> Any:
    """A value valid for simple schemas: the first enum value of each property."""
    if not isinstance(schema, dict):
        return None
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _value_for(schema[key][0])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: _value_for(sub) for name, sub in props.items()}
    return {"array": [], "string": "", "number": 0, "integer": 0, "boolean": False}.get(str(kind))


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; answers requests in order."""

    def __init__(self, server: FakeUpstream) -> None:
        self.server = server
        self.buf = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._connections.discard(self)
        if self.task is not None:
            self.task.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._process()

    def _process(self) -> None:
        while self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            try:
                method, path, _ = lines[0].split(" ", 2)
            except ValueError:
                self.transport.write(_response(400, _error_body("bad request line", "bad")))
                self.transport.close()
                return
            headers: dict[str, str] = {}
            for line in lines[1:]:
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
            total = end + 4 + int(headers.get("content-length", "0") or 0)
            if len(self.buf) < total:
                return
            body = bytes(self.buf[end + 4 : total])
            del self.buf[:total]
            close = headers.get("connection", "").lower() == "close"
            result = self.server._handle(method, path, headers, body)
            if isinstance(result, bytes):
                self.transport.write(result)
                if close:
                    self.transport.close()
                    return
                continue
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(self._finish(result, close))
            return

    async def _finish(self, pending: Awaitable[bytes], close: bool) -> None:
        response = await pending
        self.task = None
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(response)
        self.busy = False
        if close:
            self.transport.close()
        else:
            self._process()


class FakeUpstream:
    """An OpenAI-compatible fake upstream on 127.0.0.1, run in a background thread.

    ``mode`` is ``"echo"`` (parses the request; answers ``echo: <last user
    text>``, usage from whitespace word counts) or ``"instant"`` (a constant
    answer without parsing the body: the benchmark's upstream). Faults queued
    with ``fail_next``/``malformed_next`` are served first, one per request;
    then the per-second limiter (``rpm`` / 60 requests per 1-second window,
    rounded down, at least 1: ``window="fixed"`` counts per calendar second,
    ``"rolling"`` in any second, the stricter of the two); then ``delay_s``
    and model warming. A refusal carries ``Retry-After``, ``retry-after-ms``
    and ``x-ratelimit-*`` as OpenAI sends them.
    """

    def __init__(
        self,
        *,
        mode: str = "echo",
        rpm: int | None = None,
        window: str = "fixed",
        delay_s: float = 0.0,
        warm_delay_s: dict[str, float] | None = None,
        api_key: str | None = None,
        time_fn: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
        port: int = 0,
        prompt_cache: bool = False,
    ) -> None:
        self.mode = mode
        self.prompt_cache = prompt_cache
        self._prompts_seen: list[list[str]] = []
        self.rpm = rpm
        if window not in ("fixed", "rolling"):
            raise ValueError(f"window must be 'fixed' or 'rolling', not {window!r}")
        self.window = window
        self._recent: deque[float] = deque()
        self.delay_s = delay_s
        self.warm_delay_s: dict[str, float] = dict(warm_delay_s or {})
        self.api_key = api_key
        self.time_fn = time_fn
        self.host = host
        self.port = port
        self.requests = 0
        self.rate_limited = 0
        self.loads = 0
        self.statuses: Counter[int] = Counter()
        self.last_request: dict[str, Any] | None = None
        self.last_headers: dict[str, str] = {}
        self._faults: deque[tuple[str, Any, Any]] = deque()
        self._arrived: list[str] = []
        self._answered: list[str] = []
        self._hold_from: int | None = None
        self._gate: asyncio.Event | None = None
        self._held = 0
        self._abandoned = 0
        self._lock = threading.Lock()
        self._window = -1
        self._window_used = 0
        self._warm: set[str] = set()
        #: Calls that arrived while their model was cold and waited for its load.
        self.waited_for_load = 0
        self._warming: dict[str, asyncio.Event] = {}
        self._connections: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    # -- knobs ---------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def per_second(self) -> int | None:
        return None if self.rpm is None else max(1, self.rpm // 60)

    def fail_next(
        self, n: int = 1, *, status: int = 500, retry_after: float | str | None = None
    ) -> None:
        """Answer the next ``n`` requests with ``status`` (and ``Retry-After`` if given)."""
        with self._lock:
            self._faults.extend(("fail", status, retry_after) for _ in range(n))

    def malformed_next(self, n: int = 1, *, kind: str = "invalid_json") -> None:
        """Answer the next ``n`` requests with 200 and a broken body.

        ``kind`` is ``invalid_json`` (truncated JSON), ``missing_usage``, or
        ``mistyped_stream_usage`` (a stream whose closing usage has a word for a count).
        """
        with self._lock:
            self._faults.extend(("malformed", kind, None) for _ in range(n))

    def hold(self, after: int = 0) -> None:
        """Answer ``after`` more calls, then hold every later call open until ``release``."""
        with self._lock:
            self._hold_from = len(self._arrived) + after

    def release(self) -> None:
        """Answer every held call now (to callers still connected) and hold no more."""
        with self._lock:
            self._hold_from = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._open_gate)

    @property
    def arrived(self) -> list[str]:
        """The last user text of every call that reached the model, in arrival order."""
        with self._lock:
            return list(self._arrived)

    @property
    def answered(self) -> list[str]:
        """The last user text of every call answered with a completion."""
        with self._lock:
            return list(self._answered)

    @property
    def held(self) -> int:
        """Calls held open right now."""
        with self._lock:
            return self._held

    @property
    def abandoned(self) -> int:
        """Held calls whose caller went away before they were answered."""
        with self._lock:
            return self._abandoned

    def is_warm(self, model: str) -> bool:
        return model in self._warm

    def cool(self, model: str | None = None) -> None:
        """Forget that ``model`` (or every model) is warm, as after an eviction."""
        if model is None:
            self._warm.clear()
        else:
            self._warm.discard(model)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> FakeUpstream:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    loop.create_server(
                        lambda: _Connection(self), self.host, self.port, backlog=2048
                    )
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                self._server.close()
                for conn in list(self._connections):
                    if conn.transport is not None:
                        conn.transport.abort()
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fake-upstream", daemon=True)
        self._thread.start()
        ready.wait(HANG_S)
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(HANG_S)
        self._loop = self._thread = None

    def __enter__(self) -> FakeUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- request handling (runs on the server's loop) --------------------------

    def _handle(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> bytes | Awaitable[bytes]:
        self.requests += 1
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return self._count(401, _response(401, _error_body("bad key", "invalid_api_key")))
        if method == "GET" and path.endswith("/models"):
            return self._count(200, _response(200, b'{"object":"list","data":[]}'))
        if method == "POST" and path.endswith("/embeddings"):
            return self._embeddings(body)
        if method != "POST" or not path.endswith("/chat/completions"):
            return self._count(404, _response(404, _error_body("no such route", "not_found")))
        if self._faults:
            with self._lock:
                fault = self._faults.popleft() if self._faults else None
            if fault is not None:
                return self._fault(*fault)
        limit_headers: list[tuple[str, str]] = []
        if self.rpm is not None:
            limited, limit_headers = self._take_slot()
            if limited is not None:
                return limited
        if (
            self.mode == "instant"
            and not limit_headers
            and not self.delay_s
            and not self.warm_delay_s
        ):
            self.statuses[200] += 1
            return _INSTANT_RESPONSE
        try:
            request = json.loads(body) if self.mode != "instant" else {"model": "fake"}
        except ValueError:
            return self._count(400, _response(400, _error_body("body is not JSON", "invalid_json")))
        if not isinstance(request, dict):
            return self._count(400, _response(400, _error_body("body is not an object", "bad")))
        if self.mode != "instant":
            self.last_request = request
            self.last_headers = headers
        model = str(request.get("model", ""))
        if self.mode != "instant":
            with self._lock:
                self._arrived.append(_last_user_text(request))
                held = self._hold_from is not None and len(self._arrived) > self._hold_from
            if held:
                return self._held_call(request, model, limit_headers)
        if self.delay_s > 0 or (model in self.warm_delay_s and model not in self._warm):
            return self._slow(request, model, limit_headers)
        return self._answer(request, limit_headers)

    def _open_gate(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    async def _held_call(
        self, request: dict[str, Any], model: str, headers: list[tuple[str, str]]
    ) -> bytes:
        if self._gate is None:
            self._gate = asyncio.Event()
        gate = self._gate
        with self._lock:
            self._held += 1
        try:
            await gate.wait()
        except asyncio.CancelledError:
            # The connection dropped (the caller died) while the call was held.
            with self._lock:
                self._abandoned += 1
            raise
        finally:
            with self._lock:
                self._held -= 1
        return await self._slow(request, model, headers)

    def _count(self, status: int, response: bytes) -> bytes:
        self.statuses[status] += 1
        if status == 429:
            self.rate_limited += 1
        return response

    def _fault(self, kind: str, arg: Any, retry_after: Any) -> bytes:
        if kind == "malformed":
            if arg == "missing_usage":
                body = json.dumps(
                    {
                        "id": "chatcmpl-fake",
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": "hi"}}
                        ],
                    }
                ).encode()
            elif arg == "mistyped_stream_usage":
                events = [
                    {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                    {"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": 1}},
                ]
                sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                return self._count(200, _response(200, sse.encode(), [], "text/event-stream"))
            else:
                body = b'{"id": "chatcmpl-fake", "choices": [tru'
            return self._count(200, _response(200, body))
        status = int(arg)
        headers = []
        if retry_after is not None:
            headers.append(("retry-after", str(retry_after)))
        code = "rate_limit_exceeded" if status == 429 else "server_error"
        return self._count(
            status, _response(status, _error_body(f"scripted {status}", code), headers)
        )

    def _take_slot(self) -> tuple[bytes | None, list[tuple[str, str]]]:
        now = self.time_fn()
        per_second = self.per_second or 1
        if self.window == "rolling":
            recent = self._recent
            while recent and recent[0] <= now - 1.0:
                recent.popleft()
            used = len(recent)
            reset = max(0.001, recent[0] + 1.0 - now) if recent else 0.001
        else:
            window = math.floor(now)
            if window != self._window:
                self._window, self._window_used = window, 0
            used = self._window_used
            reset = max(0.001, window + 1 - now)
        if used >= per_second:
            headers = [
                ("x-ratelimit-limit-requests", str(self.rpm)),
                ("x-ratelimit-remaining-requests", "0"),
                ("x-ratelimit-reset-requests", f"{round(reset * 1000)}ms"),
                ("retry-after", str(math.ceil(reset))),
                ("retry-after-ms", str(round(reset * 1000))),
            ]
            body = _error_body(
                f"Rate limit reached: {per_second} requests per second", "rate_limit_exceeded"
            )
            return self._count(429, _response(429, body, headers)), headers
        if self.window == "rolling":
            self._recent.append(now)
        else:
            self._window_used += 1
        return None, [
            ("x-ratelimit-limit-requests", str(self.rpm)),
            ("x-ratelimit-remaining-requests", str(per_second - used - 1)),
            ("x-ratelimit-reset-requests", f"{round(reset * 1000)}ms"),
        ]

    async def _slow(
        self, request: dict[str, Any], model: str, headers: list[tuple[str, str]]
    ) -> bytes:
        warm_delay = self.warm_delay_s.get(model)
        if warm_delay is not None and model not in self._warm:
            self.waited_for_load += 1
            event = self._warming.get(model)
            if event is None:
                event = self._warming[model] = asyncio.Event()
                self.loads += 1
                try:
                    await asyncio.sleep(warm_delay)
                    self._warm.add(model)
                finally:
                    del self._warming[model]
                    event.set()
            else:
                await event.wait()
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return self._answer(request, headers)

    def _answer(self, request: dict[str, Any], headers: list[tuple[str, str]]) -> bytes:
        if self.mode == "instant":
            self.statuses[200] += 1
            return _response(200, _INSTANT_BODY, headers)
        messages = request.get("messages") or []
        words = [
            w for m in messages if isinstance(m, dict) for w in _text_of(m.get("content")).split()
        ]
        prompt_tokens = len(words)
        details = self._cache_read(words)
        last_user = _last_user_text(request)
        with self._lock:
            self._answered.append(last_user)
        max_tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
        fmt = request.get("response_format") or {}
        finish = "stop"
        if fmt.get("type") == "json_schema":
            text = json.dumps(_value_for((fmt.get("json_schema") or {}).get("schema")))
        elif fmt.get("type") == "json_object":
            text = "{}"
        else:
            words = ["echo:", *last_user.split()]
            reply = ["echo:", *last_user.split()]
            if len(reply) > max_tokens:
                reply, finish = reply[:max_tokens], "length"
            text = " ".join(reply)
        n = int(request.get("n") or 1)
        calls = None
        tools = request.get("tools") or []
        if tools and request.get("tool_choice") != "none":
            fn = tools[0]["function"]
            args = json.dumps(_value_for(fn.get("parameters")))
            calls = [
                {
                    "id": "call_fake_1",
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args},
                }
            ]
            text, finish = "", "tool_calls"
        if request.get("stream"):
            return self._stream(request, text, finish, calls, prompt_tokens, details, headers)
        choices = []
        for index in range(n):
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": text or None, "tool_calls": calls}
                if calls
                else {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
            if request.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": w, "logprob": -0.25, "bytes": list(w.encode())}
                        for w in text.split()
                    ]
                }
            choices.append(choice)
        completion_tokens = n * len(text.split())
        body = {
            "id": f"chatcmpl-{self.requests}",
            "object": "chat.completion",
            "model": request.get("model", "fake"),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                **details,
            },
        }
        return self._count(200, _response(200, json.dumps(body).encode(), headers))

    def _cache_read(self, words: list[str]) -> dict[str, Any]:
        """With ``prompt_cache``: OpenAI's ``prompt_tokens_details``, a prefix cache's count.

        A prompt's cached tokens are the most leading words it shares with a
        prompt answered before (a word a token, as the usage counts them), as a
        server that keeps every prompt's prefix would report them.
        """
        if not self.prompt_cache:
            return {}
        with self._lock:
            cached = max((_shared_prefix(words, seen) for seen in self._prompts_seen), default=0)
            self._prompts_seen.append(words)
        return {"prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0}}

    def _stream(
        self,
        request: dict[str, Any],
        text: str,
        finish: str,
        calls: list[dict[str, Any]] | None,
        prompt_tokens: int,
        details: dict[str, Any],
        headers: list[tuple[str, str]],
    ) -> bytes:
        """The answer as OpenAI's server-sent events: a word a chunk, then the usage."""

        def event(choices: list[dict[str, Any]], usage: Any = None) -> str:
            body = {
                "id": f"chatcmpl-{self.requests}",
                "object": "chat.completion.chunk",
                "model": request.get("model", "fake"),
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return "data: " + json.dumps(body) + "\n\n"

        parts = [event([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}])]
        for k, word in enumerate(text.split()):
            piece = word if k == 0 else " " + word
            parts.append(event([{"index": 0, "delta": {"content": piece}, "finish_reason": None}]))
        if calls:
            fragment = [{**calls[0], "index": 0}]
            parts.append(
                event([{"index": 0, "delta": {"tool_calls": fragment}, "finish_reason": None}])
            )
        parts.append(event([{"index": 0, "delta": {}, "finish_reason": finish}]))
        if (request.get("stream_options") or {}).get("include_usage"):
            out = len(text.split())
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": out,
                "total_tokens": prompt_tokens + out,
                **details,
            }
            parts.append(event([], usage))
        parts.append("data: [DONE]\n\n")
        body = "".join(parts).encode()
        return self._count(200, _response(200, body, headers, "text/event-stream"))

    def _embeddings(self, body: bytes) -> bytes:
        request = json.loads(body)
        texts = request["input"] if isinstance(request["input"], list) else [request["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(t)), 1.0, 0.0]}
            for i, t in enumerate(texts)
        ]
        tokens = sum(len(t.split()) for t in texts)
        answer = {
            "object": "list",
            "data": data,
            "model": request.get("model"),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return self._count(200, _response(200, json.dumps(answer).encode()))
