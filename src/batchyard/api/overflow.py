"""A body over the limit still gets its coded 413: the excess is read and dropped first.

A handler refuses an oversized body as soon as it knows (its ``Content-Length``,
or the byte that crosses the cap) and answers ``413 request_too_large``. A client
that writes its whole body before it reads anything (Python's ``urllib``, most
simple clients) is then still sending: were the server to answer and close, the
unread bytes make the kernel reset the connection, and the client sees a broken
pipe instead of the answer. So before a 413 leaves, this middleware reads what is
left of the body, up to ``DRAIN_LIMIT`` more bytes, and throws it away; the
client finishes sending, then reads the 413.

The excess is bounded so a client cannot make the server read without end: a body
declared (or found) larger than that is answered at once with ``Connection:
close``. A client that sent ``Expect: 100-continue`` and has not been asked for its
body yet is never asked: it sends nothing more and reads the 413 as it is.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["DRAIN_LIMIT", "OverflowMiddleware"]

#: The most bytes read and dropped after a body was refused as too large.
DRAIN_LIMIT = 16 * 1024 * 1024


def _declared(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def _expects_continue(scope: Scope) -> bool:
    return any(
        name == b"expect" and value.lower() == b"100-continue"
        for name, value in scope.get("headers", ())
    )


class OverflowMiddleware:
    def __init__(self, app: ASGIApp, *, drain_limit: int = DRAIN_LIMIT) -> None:
        self.app = app
        self.drain_limit = drain_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        asked = False
        ended = False

        async def tracked() -> Message:
            nonlocal received, asked, ended
            asked = True
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                ended = ended or not message.get("more_body", False)
            elif message["type"] == "http.disconnect":
                ended = True
            return message

        async def drained(message: Message) -> Message:
            """The 413's start, once the rest of the body is read (or cannot be)."""
            nonlocal ended
            declared = _declared(scope)
            can_drain = not (
                (_expects_continue(scope) and not asked)
                or (declared is not None and declared - received > self.drain_limit)
            )
            start = received
            while can_drain and not ended and received - start <= self.drain_limit:
                await tracked()
            if ended:
                return message
            headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
            return {**message, "headers": [*headers, (b"connection", b"close")]}

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 413 and not ended:
                message = await drained(message)
            await send(message)

        await self.app(scope, tracked, guarded)
