"""Helpers for the workspace tests: sign in over real HTTP, read tokens off pages."""

from __future__ import annotations

import re
from typing import Any

import httpx

from batchyard.engines.scripted import ScriptedEngine
from batchyard.service import Service

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
_IDEM = re.compile(r'name="idempotency_key" value="([^"]+)"')


def csrf_of(html: str) -> str:
    match = _CSRF.search(html)
    assert match, "no CSRF token on the page"
    return match.group(1)


def idem_of(html: str) -> str:
    match = _IDEM.search(html)
    assert match, "no Idempotency-Key field on the page"
    return match.group(1)


def answer_with(service: Service, text: str = "release summary") -> ScriptedEngine:
    """The default catalog's kettei-core runs on ``embedded`` (95 % off, hard caps)."""
    engine = ScriptedEngine(text, clock=service.clock)
    service.engines.set("embedded", engine)
    return engine


async def sign_in(http: httpx.AsyncClient, key: str) -> httpx.Response:
    """GET the sign-in page (its token cookie and field), then POST the key."""
    page = await http.get("/workspace/")
    assert page.status_code == 200, page.text
    return await http.post("/workspace/sign-in", data={"api_key": key, "csrf": csrf_of(page.text)})


async def signed_in(http: httpx.AsyncClient, key: str) -> str:
    """Sign in; the batches page's HTML."""
    r = await sign_in(http, key)
    assert r.status_code == 303 and r.headers["location"] == "/workspace/batches", r.text
    page = await http.get("/workspace/batches")
    assert page.status_code == 200, page.text
    return page.text


async def submit_form(
    http: httpx.AsyncClient, body: str, *, key: str | None = None, **extra: Any
) -> httpx.Response:
    page = (await http.get("/workspace/batches")).text
    data = {
        "csrf": csrf_of(page),
        "body": body,
        "idempotency_key": key or idem_of(page),
        **extra,
    }
    return await http.post("/workspace/batches", data=data)
