"""The OpenAPI document against the routes: every operation documented, as it is sent."""

from __future__ import annotations

import re

from batchyard.api.openapi import ErrorBody, operations
from batchyard.app import create_app
from batchyard.service import Service


def test_every_operation_has_its_body_its_answer_and_the_error_body(service: Service) -> None:
    app = create_app(service)
    doc = app.openapi()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["ErrorDetail"]["required"]) == {"code", "type", "message", "retryable"}
    declared = operations(app)
    assert set(declared) == {(m, p) for p, ops in doc["paths"].items() for m in ops}
    for (method, path), spec in declared.items():
        op = doc["paths"][path][method]
        assert "422" not in op["responses"], (method, path)
        ok = op["responses"][str(spec.success)]
        assert ok["content"], (method, path)
        assert "x-ratelimit-remaining-requests" in ok["headers"]
        assert spec.public or {401, 500, 503} <= set(spec.errors), (method, path)
        for status in spec.errors:
            error = op["responses"][str(status)]
            # Anthropic's door answers its own envelope; a probe answers its own body.
            envelope = (
                "AnthropicErrorBody"
                if path.startswith("/v1/messages")
                else (spec.response if spec.public else ErrorBody).__name__
            )
            assert error["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{envelope}"
            }
            assert "x-should-retry" in error["headers"]
        if spec.body is not None:
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            for ref in [s["$ref"] for s in schema.get("anyOf", [schema])]:
                assert ref.rsplit("/", 1)[1] in schemas
    assert declared["post", "/v1/chat/completions"].errors == (
        400,
        401,
        402,
        403,
        404,
        409,
        413,
        415,
        429,
        500,
        502,
        503,
        504,
    )
    assert 529 in declared["post", "/v1/messages"].errors
    assert declared["get", "/healthz"].errors == (503,)
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


def _body(doc, method: str, path: str) -> dict:
    return doc["paths"][path][method]["requestBody"]


def _validator(doc, schema: dict):
    from jsonschema import Draft202012Validator

    return Draft202012Validator({**schema, "components": doc["components"]})


def test_request_bodies_require_what_the_server_requires(service: Service) -> None:
    doc = create_app(service).openapi()
    batches = _validator(
        doc, _body(doc, "post", "/v1/batches")["content"]["application/json"]["schema"]
    )
    # {} is a 400 min_discount_required (deferred) or input_file_id (file batch) on the wire.
    assert not batches.is_valid({})
    assert not batches.is_valid({"requests": [], "completion_window": "24h"})
    assert batches.is_valid(
        {
            "min_discount": 20,
            "requests": [
                {
                    "custom_id": "a",
                    "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                }
            ],
        }
    )
    assert batches.is_valid(
        {"input_file_id": "file.x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )
    assert not batches.is_valid({"input_file_id": "file.x", "endpoint": "/v1/chat/completions"})
    schemas = doc["components"]["schemas"]
    expected = {
        "DecideBody": {"model", "input", "decisions"},
        "KeepWarmBody": {"minutes"},
        "ProjectBody": {"name"},
        "DatasetBody": {"name"},
        "RowPatchBody": {"data"},
        "RunBody": {"datasetId", "model", "output"},
        "ChatRequest": {"model", "messages"},
        "CompletionTextRequest": {"model", "prompt"},
        "EmbeddingRequest": {"model", "input"},
        "BatchBody": {"min_discount", "requests"},
        "FileBatchBody": {"input_file_id", "endpoint", "completion_window"},
    }
    for name, required in expected.items():
        assert set(schemas[name]["required"]) == required, name
    assert schemas["DecideBody"]["properties"]["decisions"]["minItems"] == 1
    upload = _body(doc, "post", "/v1/files")["content"]["multipart/form-data"]["schema"]
    assert set(upload["required"]) == {"purpose", "file"}


def test_every_path_parameter_is_declared(service: Service) -> None:
    doc = create_app(service).openapi()
    for path, ops in doc["paths"].items():
        named = set(re.findall(r"\{([^}]+)\}", path))
        for method, op in ops.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == named, (method, path)


def test_calls_that_take_no_body_do_not_require_one(service: Service) -> None:
    doc = create_app(service).openapi()
    runs = "/v1/projects/{project_id}/batch-inference-runs/{run_id}"
    for path in (f"{runs}/cancel", f"{runs}/confirm", "/v1/batches/{batch_id}/cancel"):
        body = _body(doc, "post", path)
        assert body["required"] is False, path
        empty = _validator(doc, body["content"]["application/json"]["schema"])
        assert empty.is_valid({}) and not empty.is_valid({"reason": "x"}), path


def test_the_wire_check_finds_what_disagrees(service: Service) -> None:
    """The suite-wide check (tests.support.wire_check) is not vacuous."""
    from tests.support.wire_check import WireCheck

    wire = WireCheck()
    doc = wire.document(create_app(service).openapi())
    rows = "/v1/projects/pp.x/datasets/ds.y/rows"
    listed = b'{"object": "list", "data": [], "hasMore": false, "nextCursor": null}'
    assert wire.problems(doc, "GET", rows, 200, "application/json", listed) == []
    no_object = b'{"data": [], "hasMore": false, "nextCursor": null}'
    assert (
        "'object' is a required property"
        in wire.problems(doc, "GET", rows, 200, "application/json", no_object)[0]
    )
    assert (
        "status not documented"
        in wire.problems(doc, "GET", rows, 418, "application/json", b"{}")[0]
    )
    assert "media type" in wire.problems(doc, "GET", rows, 200, "text/html", b"<p>")[0]
    error = b'{"error": {"code": "x", "message": "y"}}'  # no retryable
    assert wire.problems(doc, "GET", rows, 404, "application/json", error)
    assert wire.problems(doc, "GET", "/workspace/batches", 200, "text/html", b"") is None
    assert wire.problems(doc, "DELETE", rows, 405, "application/json", b"{}") == []
