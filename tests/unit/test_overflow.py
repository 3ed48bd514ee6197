"""The 413's drain, at the ASGI level: what is read before the answer leaves, and when not.

The socket-level behaviour (urllib reads the 413 instead of a broken pipe) is
tested against a live server in tests/integration; these pin the bounds.
"""

from __future__ import annotations

from typing import Any

from batchyard.api.overflow import OverflowMiddleware

CHUNK = b"x" * 1000


async def refuse_at_once(scope: Any, receive: Any, send: Any) -> None:
    """A handler that refuses on Content-Length, before reading any body."""
    await send({"type": "http.response.start", "status": 413, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def refuse_after_one_chunk(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 413, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def answer_ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def scope(length: int | None, *, expect: bool = False) -> dict[str, Any]:
    headers = [] if length is None else [(b"content-length", str(length).encode())]
    if expect:
        headers.append((b"expect", b"100-continue"))
    return {"type": "http", "method": "POST", "path": "/v1/x", "headers": headers}


async def run(app: Any, scope: dict[str, Any], chunks: int, limit: int = 10_000):
    messages = [
        {"type": "http.request", "body": CHUNK, "more_body": i < chunks - 1} for i in range(chunks)
    ]
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        return messages[read - 1] if read <= len(messages) else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await OverflowMiddleware(app, drain_limit=limit)(scope, receive, send)
    return read, sent[0]


async def test_the_rest_of_the_body_is_read_before_the_413_leaves():
    read, start = await run(refuse_at_once, scope(5000), chunks=5)
    assert read == 5 and start["status"] == 413
    assert (b"connection", b"close") not in start["headers"]


async def test_a_chunked_body_refused_half_way_is_read_to_its_end():
    read, start = await run(refuse_after_one_chunk, scope(None), chunks=8)
    assert read == 8 and (b"connection", b"close") not in start["headers"]


async def test_a_body_declared_past_the_bound_is_not_read_and_the_connection_closes():
    read, start = await run(refuse_at_once, scope(50_000), chunks=50)
    assert read == 0 and (b"connection", b"close") in start["headers"]


async def test_an_endless_chunked_body_is_read_only_up_to_the_bound():
    read, start = await run(refuse_after_one_chunk, scope(None), chunks=1000)
    assert read < 20 and (b"connection", b"close") in start["headers"]


async def test_a_client_that_waits_for_100_continue_is_not_asked_for_its_body():
    read, start = await run(refuse_at_once, scope(5000, expect=True), chunks=5)
    assert read == 0 and (b"connection", b"close") in start["headers"]


async def test_other_answers_pass_untouched():
    read, start = await run(answer_ok, scope(5000), chunks=5)
    assert read == 0 and start == {"type": "http.response.start", "status": 200, "headers": []}
