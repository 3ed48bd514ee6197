"""Every response the test suite sees, checked against the app's own OpenAPI document.

``WIRE.wrap(app)`` puts an ASGI middleware around an app that
``tests.support.server`` starts (in process or on a socket), so every test
that talks to batchyard checks, on the side, that each answer is one the
document promises: the path and method are documented, the status is listed
for that operation, the media type is one it lists, and a JSON body validates
against its schema (JSON Schema 2020-12, as OpenAPI 3.1 has it, with the
document's own ``components``). The document is the live one,
``app.openapi()``, so a change to the server or to the document that makes
them disagree fails whichever test first sees it: ``tests/conftest.py`` fails
a test that saw a mismatch, and prints how many responses were checked.

Paths the document leaves out on purpose (the workspace pages, ``/metrics``,
``/docs``, ``/openapi.json``) are not checked; a 405 for a method a
documented path does not take is not a mismatch (no operation to hold it to).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["WIRE", "WireCheck"]

#: A JSON body longer than this is counted but not parsed (a page of 1,000 rows is far less).
MAX_BODY = 32 * 1024 * 1024


@dataclass
class _Document:
    """One document, its paths as patterns, and the validators made from it so far."""

    doc: dict[str, Any]
    patterns: list[tuple[re.Pattern[str], str]]
    validators: dict[tuple[str, str, str, str], Draft202012Validator] = field(default_factory=dict)

    @classmethod
    def of(cls, doc: dict[str, Any]) -> _Document:
        patterns = []
        # Literal paths first: /v1/decide/estimate is not /v1/decide/{something}.
        for template in sorted(doc.get("paths", {}), key=lambda p: (p.count("{"), p)):
            regex = re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template))
            patterns.append((re.compile(f"^{regex}$"), template))
        return cls(doc, patterns)

    def template(self, path: str) -> str | None:
        for pattern, template in self.patterns:
            if pattern.match(path):
                return template
        return None

    def validator(self, template: str, method: str, status: str, media: str) -> Any:
        key = (template, method, status, media)
        found = self.validators.get(key)
        if found is None:
            op = self.doc["paths"][template][method]
            schema = op["responses"][status]["content"][media]["schema"]
            root = {**schema, "components": self.doc.get("components", {})}
            found = self.validators[key] = Draft202012Validator(root)
        return found


class WireCheck:
    """Counts the responses checked and keeps every mismatch found (thread-safe)."""

    def __init__(self) -> None:
        self.checked = 0
        self.mismatches: list[str] = []
        self._lock = threading.Lock()
        self._documents: dict[str, _Document] = {}

    def document(self, doc: dict[str, Any]) -> _Document:
        key = json.dumps(doc, sort_keys=True)
        with self._lock:
            found = self._documents.get(key)
            if found is None:
                found = self._documents[key] = _Document.of(doc)
            return found

    def wrap(self, app: Any) -> ASGIApp:
        """``app`` (a FastAPI app) with every answer checked against its live document."""
        return _Checked(app, self, self.document(app.openapi()))

    def problems(
        self,
        document: _Document,
        method: str,
        path: str,
        status: int,
        media: str,
        body: bytes | None,
    ) -> list[str] | None:
        """What is wrong with one response (None: not the document's to check).

        A ``None`` body was not read (not JSON, or too long).
        """
        template = document.template(path)
        method = method.lower()
        if template is None or method in ("head", "options"):
            return None
        ops = document.doc["paths"][template]
        where = f"{method.upper()} {path} ({template}) -> {status}"
        if method not in ops:
            return [] if status == 405 else [f"{where}: the method is not documented"]
        responses = ops[method]["responses"]
        key = str(status) if str(status) in responses else "default"
        if key not in responses:
            listed = ", ".join(sorted(responses))
            return [f"{where}: status not documented (documented: {listed})"]
        content = responses[key].get("content") or {}
        if not content:
            return []
        if media not in content:
            return [f"{where}: media type {media!r} not documented ({', '.join(content)})"]
        if media != "application/json" or body is None:
            return []
        try:
            value = json.loads(body)
        except ValueError as exc:
            return [f"{where}: the body is not JSON ({exc})"]
        errors = sorted(
            document.validator(template, method, key, media).iter_errors(value),
            key=lambda e: list(e.absolute_path),
        )
        return [
            f"{where}: at {'/'.join(str(p) for p in e.absolute_path) or 'the top'}: "
            f"{e.message[:300]}"
            for e in errors[:5]
        ]

    def record(self, problems: list[str] | None) -> None:
        if problems is None:
            return
        with self._lock:
            self.checked += 1
            self.mismatches.extend(problems)


class _Checked:
    """The ASGI middleware: reads what the app sends, checks it before the last byte goes."""

    def __init__(self, app: Any, wire: WireCheck, document: _Document) -> None:
        self.app = app
        self.wire = wire
        self.document = document

    def __getattr__(self, name: str) -> Any:
        # ``app.router.lifespan_context`` and the like, for whoever holds the wrapped app.
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        media = ""
        chunks: list[bytes] | None = []
        size = 0

        async def checked_send(message: Message) -> None:
            nonlocal status, media, chunks, size
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for name, value in message.get("headers", []):
                    if name.lower() == b"content-type":
                        media = value.decode("latin-1").split(";")[0].strip().lower()
                if media != "application/json":
                    chunks = None
            elif message["type"] == "http.response.body":
                part = message.get("body", b"")
                if chunks is not None:
                    size += len(part)
                    if size > MAX_BODY:
                        chunks = None
                    else:
                        chunks.append(part)
                if not message.get("more_body", False):
                    body = b"".join(chunks) if chunks is not None else None
                    self.wire.record(
                        self.wire.problems(
                            self.document, scope["method"], scope["path"], status, media, body
                        )
                    )
            await send(message)

        await self.app(scope, receive, checked_send)


#: The suite's one checker: ``tests.support.server`` wraps every app it starts with it.
WIRE = WireCheck()
