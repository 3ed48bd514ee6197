"""A newcomer's first ``batchyard run``: the shipped example on the embedded model, all answered.

Default settings, an organisation at tier 1 (whose pace alone would start twenty
workers), the real model on this
machine's CPU, the real CLI. The runner must fit the engine (two contexts, a
few seconds a text on two cores): no text may fail on the first run, however
slow the model is, and the plan it prints says how long the run will take.
This is the suite's one slow test of the runner on the real model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchyard.cli.text_runner import command as run_command
from tests.support.threaded_server import Gateway, ServerThread

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "data"

pytestmark = pytest.mark.model


@pytest.fixture
def gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHYARD_CONFIG", raising=False)
    server = ServerThread(tmp_path)
    try:
        yield server.start()
    finally:
        server.stop()
    assert server.problems == [], server.problems


@pytest.mark.timeout(900)
def test_the_shipped_example_is_answered_whole_on_the_first_run(gateway, tmp_path):
    key = gateway.org("newcomer", tier=1, credit="5")
    out = tmp_path / "answers.jsonl"
    result = CliRunner().invoke(
        run_command,
        [
            str(EXAMPLES / "comments.jsonl"),
            "--decisions",
            str(EXAMPLES / "decisions.yaml"),
            "--model",
            "kettei-core",
            "--output",
            str(out),
            "--base-url",
            gateway.base,
            "--api-key",
            key,
        ],
        env={"COLUMNS": "400", **{k: v for k, v in os.environ.items() if k == "PATH"}},
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    answers = [r for r in rows if "answers" in r]
    assert len({r["id"] for r in answers}) == 40
    assert not out.with_suffix(".errors.jsonl").exists()
    # Two workers (the embedded model's contexts), not twenty; and a time from
    # the model's measured pace, not only from the tier's requests a minute.
    assert "2 workers (kettei-core's concurrency)" in result.output, result.output
    assert "first text answered in" in result.output and "Time: about" in result.output
    assert "Answered 40 this run" in result.output
