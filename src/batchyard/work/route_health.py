"""What this process last heard from each route: down, holding calls back, or fine.

The dispatcher notes every call's outcome here: a route whose upstream
refused the connection is *down* from that call until one answers; a route
whose upstream answered 429 is *limited* until one answers. The stuck-work
watch (``work.stuck_watch``) reads it to say why work waits; nothing else
decides on it (a call to a route that is down is still tried, so the first
one to get through brings the route back).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

__all__ = ["RouteHealth", "Trouble"]

TroubleKind = Literal["route_down", "limits"]


@dataclass(frozen=True, slots=True)
class Trouble:
    """A route's trouble: which kind, since when, and the last failure's message."""

    kind: TroubleKind
    since: datetime
    detail: str


class RouteHealth:
    """Per route: the trouble it is in since its last answer, if any."""

    def __init__(self) -> None:
        self._trouble: dict[str, Trouble] = {}

    def failed(self, route_id: str, kind: TroubleKind, at: datetime, detail: str) -> None:
        """A call to the route failed this way; the trouble's start is kept while it lasts."""
        now = self._trouble.get(route_id)
        since = now.since if now is not None and now.kind == kind else at
        self._trouble[route_id] = Trouble(kind, since, detail)

    def answered(self, route_id: str) -> None:
        """A call to the route came back: whatever trouble it was in is over."""
        self._trouble.pop(route_id, None)

    def trouble(self, route_id: str) -> Trouble | None:
        return self._trouble.get(route_id)
