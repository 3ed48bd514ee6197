"""Reading a ``/finished`` endpoint (any batch kind's, a run's) page by page from a cursor."""

from __future__ import annotations

from typing import Any

import httpx


async def read_pages(
    http: httpx.AsyncClient, path: str, headers: dict[str, str], cursor: str, limit: int
) -> tuple[list[dict[str, Any]], str, bool]:
    """Every page from ``cursor`` on, ``limit`` at a time: (items, new cursor, ended)."""
    got: list[dict[str, Any]] = []
    while True:
        r = await http.get(path, params={"after": cursor, "limit": limit}, headers=headers)
        assert r.status_code == 200, r.text
        page = r.json()
        assert set(page) == {"object", "data", "cursor", "has_more", "ended"}
        assert page["object"] == "list" and len(page["data"]) <= limit
        got += page["data"]
        assert int(page["cursor"]) >= int(cursor)
        cursor = page["cursor"]
        if not page["has_more"]:
            return got, cursor, page["ended"]
