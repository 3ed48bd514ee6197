"""Schemathesis over the live app, from its own OpenAPI document, with every check on.

A server on loopback (default settings, the scripted engine in place of the
embedded model) is loaded by schemathesis from its ``/openapi.json``; for
every operation, Hypothesis draws requests the document allows and requests it
forbids (bodies, path and query parameters) with a full-scope key of a funded
organisation, and each answer must pass every one of schemathesis's checks:
not a server error, a documented status, content type, headers and body; a
request the document allows is accepted and one it forbids refused; no
undeclared method or missing header slips through. The document and the
server agree, both ways.

Some rules no JSON schema can hold are the server's alone. The draws keep to
one: no NUL character in any string (PostgreSQL cannot store one; every door
refuses it, ``core.inputs``). The others are facts of the deployment, answered
with a status a valid request may meet: a model nobody serves is ``404``
before any rule between a body's fields, a webhook host the operator's
networks forbid ``403``, the twenty-first webhook endpoint ``409``. So every
check is on, ``positive_data_acceptance`` included. The examples are derandomized
(a fixed seed, no example database), so CI runs the same requests every time;
``SCHEMATHESIS_EXAMPLES`` sets how many an operation gets.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from batchyard.core.clock import SystemClock
from batchyard.engines.scripted import ScriptedEngine
from batchyard.service import Service
from tests.support.threaded_server import Gateway, ServerThread

EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "15"))


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
    schema.config.generation.update(allow_x00=False)
    failures: list[str] = []
    ran: dict[str, int] = {}
    cases = [
        (result.ok(), mode)
        for result in schema.get_all_operations()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    for operation, mode in cases:
        label = f"{operation.method.upper()} {operation.path} ({mode.value})"

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            ran[label] = ran.get(label, 0) + 1
            # No checks named: every check schemathesis has.
            case.call_and_validate(base_url=gateway.base, headers=auth)

        try:
            check()
        except Unsatisfiable:
            # Negative mode for an operation with nothing the document forbids (no body,
            # free-form path ids): there is no such request to send.
            assert mode is GenerationMode.NEGATIVE, label
        except (Exception, BaseExceptionGroup) as exc:  # every operation tried, all reported
            failures.append(f"{label}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
    assert sum(label.endswith("(positive)") for label in ran) >= 30, ran
    assert sum(label.endswith("(negative)") for label in ran) >= 20, ran
