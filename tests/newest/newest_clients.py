"""The newest ``openai`` and ``anthropic`` releases, unchanged, against a live batchyard.

The pinned SDKs (``pyproject.toml``: LangChain and LiteLLM hold ``openai`` below
3) drive ``tests/integration/compat``; this drives the newest ones, installed in
an environment of their own (``make newest-clients`` makes ``.venv-newest``
with ``pip install -U openai anthropic``). The server runs here, on a real
socket with the embedded model; each SDK's examples run in the newest
environment's interpreter (``BATCHYARD_NEWEST_PYTHON``) as a user would run
them, and pass when they exit 0.

Not a ``test_*`` file: only ``make newest-clients`` runs it, since it needs
that second environment.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.threaded_server import Gateway, ServerThread

# The examples run on the embedded model (a parse under a grammar is the longest).
pytestmark = [pytest.mark.model, pytest.mark.timeout(1200)]
HERE = Path(__file__).parent
PYTHON = os.environ.get("BATCHYARD_NEWEST_PYTHON", ".venv-newest/bin/python")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    home = tmp_path_factory.mktemp("newest")
    os.environ["BATCHYARD_HOME"] = str(home)
    server = ServerThread(home)
    try:
        yield server.start()
    finally:
        server.stop()
    assert server.problems == [], server.problems


def run(gateway: Gateway, script: str, key: str) -> str:
    env = {
        **os.environ,
        "BATCHYARD_URL": gateway.url,
        "BATCHYARD_BASE": gateway.base,
        "BATCHYARD_KEY": key,
    }
    done = subprocess.run(
        [PYTHON, str(HERE / script)], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_newest_openai_sdks_examples(gateway: Gateway) -> None:
    out = run(gateway, "openai_examples.py", gateway.org("newest-openai"))
    assert "openai examples: ok" in out


def test_the_newest_anthropic_sdks_examples(gateway: Gateway) -> None:
    out = run(gateway, "anthropic_examples.py", gateway.org("newest-anthropic"))
    assert "anthropic examples: ok" in out
