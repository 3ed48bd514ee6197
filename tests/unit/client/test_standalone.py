"""The client loads without any of the server's code or dependencies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[3] / "src")


def test_importing_the_client_and_its_commands_pulls_in_nothing_of_the_server() -> None:
    code = (
        "import sys, json\n"
        "import batchyard.client, batchyard.client.text_runner, batchyard.client.check\n"
        "import batchyard.cli.text_runner, batchyard.cli.check\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(out.stdout))
    server_side = {
        "fastapi",
        "sqlalchemy",
        "pydantic",
        "llama_cpp",
        "uvicorn",
        "pyarrow",
        "batchyard.core",
        "batchyard.store",
        "batchyard.engines",
        "batchyard.work",
        "batchyard.api",
        "batchyard.web",
    }
    assert loaded & server_side == set()
