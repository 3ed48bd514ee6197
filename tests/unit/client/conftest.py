"""Fixtures for the client's tests: a fake gateway on loopback and sample files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.fake_gateway import DECISIONS, FakeGateway


@pytest.fixture(scope="module")
def _gateway_server() -> Iterator[FakeGateway]:
    with FakeGateway() as gw:
        yield gw


@pytest.fixture
def gateway(_gateway_server: FakeGateway) -> FakeGateway:
    """The module's fake gateway, reset to its starting state for this test."""
    _gateway_server.reset()
    return _gateway_server


@pytest.fixture
def decisions_file(tmp_path: Path) -> Path:
    path = tmp_path / "decisions.json"
    path.write_text(json.dumps({"decisions": DECISIONS}))
    return path
