"""HTTP requests counted for ``/metrics``: by route template, method and status, with latency.

The outermost middleware, so it sees the status the envelope's last-resort
500 sent too. The route label is the template the router matched
(``/v1/runs/{run_id}``), never the raw path, so the number of series stays
bounded; a path no route matched is ``unmatched``. The time is read from the
deployment's clock (``core.clock``), from the first byte in to the last out.
A request whose client hung up before any answer is counted as status 499.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchyard.core.clock import Clock
from batchyard.core.telemetry import Recorder

__all__ = ["MeteringMiddleware", "route_template"]


def route_template(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MeteringMiddleware:
    def __init__(self, app: ASGIApp, *, recorder: Recorder, clock: Clock) -> None:
        self.app = app
        self._recorder = recorder
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = self._clock.time()
        status = 0

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except BaseException:
            status = status or 500  # escaped before an answer started
            raise
        finally:
            # No answer and no error: the client hung up first (nginx's 499).
            status = status or 499
            elapsed = self._clock.time() - started
            self._recorder.http_request(route_template(scope), scope["method"], status, elapsed)
