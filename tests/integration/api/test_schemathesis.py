"""Schemathesis over the live app, from its own OpenAPI document: no 5xx, every answer valid.

A server on loopback (default settings, the scripted engine in place of the
embedded model) is loaded by schemathesis from its ``/openapi.json``; for
every operation, Hypothesis draws requests the document allows (bodies, path
and query parameters) with a full-scope key of a funded organisation, and
each answer must pass schemathesis's own checks: not a server error, a
documented status, a documented content type, and a body that validates
against the documented schema. The examples are derandomized (a fixed seed,
no example database), so CI runs the same requests every time;
``SCHEMATHESIS_EXAMPLES`` sets how many an operation gets.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from batchyard.core.clock import SystemClock
from batchyard.engines.scripted import ScriptedEngine
from batchyard.service import Service
from tests.support.threaded_server import Gateway, ServerThread

EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "15"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _scripted(service: Service) -> None:
    service.engines.set("embedded", ScriptedEngine("a short answer", clock=SystemClock()))


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    server = ServerThread(tmp_path, prepare=_scripted)
    try:
        yield server.start()
    finally:
        server.stop()
    assert server.problems == [], server.problems


@pytest.mark.timeout(900)
def test_every_operation_answers_what_its_document_says(gateway: Gateway) -> None:
    key = gateway.org("fuzzed", tier=3, credit="1000")
    auth = {"Authorization": f"Bearer {key}"}
    schema = schemathesis.openapi.from_url(f"{gateway.base}/openapi.json")
    failures: list[str] = []
    ran: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            label = f"{case.operation.method.upper()} {case.operation.path}"
            ran[label] = ran.get(label, 0) + 1
            case.call_and_validate(base_url=gateway.base, headers=auth, checks=CHECKS)

        try:
            check()
        except Exception as exc:  # every operation is tried; all failures are reported
            failures.append(f"{label}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
    assert len(ran) >= 30, ran
