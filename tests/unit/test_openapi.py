"""The OpenAPI document against the routes: every operation documented, as it is sent."""

from __future__ import annotations

import re

from fastapi.routing import APIRoute

from batchyard.api.openapi import ANTHROPIC_PATHS, OPERATIONS
from batchyard.app import create_app
from batchyard.service import Service


def _routes(routes):
    for route in routes:
        inner = getattr(route, "original_router", None)  # an included router
        if inner is not None:
            yield from _routes(inner.routes)
        else:
            yield route


def _operations(app) -> set[tuple[str, str]]:
    found = set()
    for route in _routes(app.routes):
        if isinstance(route, APIRoute) and route.include_in_schema:
            found |= {(m.lower(), route.path) for m in route.methods}
    return found


def test_every_route_is_in_the_table_and_the_table_names_no_other(service: Service) -> None:
    app = create_app(service)
    assert _operations(app) == set(OPERATIONS)


def test_every_operation_has_its_body_its_answer_and_the_error_body(service: Service) -> None:
    doc = create_app(service).openapi()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["ErrorDetail"]["required"]) == {"code", "type", "message", "retryable"}
    for (method, path), spec in OPERATIONS.items():
        op = doc["paths"][path][method]
        assert "422" not in op["responses"], (method, path)
        ok = op["responses"][str(spec.success)]
        assert ok["content"], (method, path)
        assert "x-ratelimit-remaining-requests" in ok["headers"]
        envelope = "AnthropicErrorBody" if path in ANTHROPIC_PATHS else "ErrorBody"
        for status in spec.errors:
            error = op["responses"][str(status)]
            assert error["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{envelope}"
            }
            assert "x-should-retry" in error["headers"]
        if spec.body is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.rsplit("/", 1)[1] in schemas
    chat = schemas["ChatRequest"]
    assert {"model", "messages", "tools", "stream_options"} <= set(chat["properties"])
    assert chat["additionalProperties"] is False
    created = doc["paths"]["/v1/batches"]["post"]["responses"]
    # A deferred batch is created (201); OpenAI's SDK reads a file batch's 200.
    assert "201" in created and "200" in created
    projects = doc["paths"]["/v1/projects"]["post"]["responses"]
    assert "201" in projects and "200" not in projects
    upload = doc["paths"]["/v1/files"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"]
    assert "415" in upload["responses"]


async def test_the_docs_page_loads_nothing_from_elsewhere(service: Service) -> None:
    from tests.support.server import asgi_client

    async with asgi_client(service, worker=False) as http:
        page = await http.get("/docs")
        doc = await http.get("/openapi.json")
        assert (await http.get("/redoc")).status_code == 404
    assert page.status_code == 200 and "openapi.json" in page.text
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page.text)
    assert doc.status_code == 200 and doc.json()["paths"]["/v1/chat/completions"]
