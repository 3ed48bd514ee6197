"""A full disk under a real ``batchyard serve``: 503, retryable, no half-state, no stranded hold.

The server's SQLite file lives on a tmpfs of a few MB that only the server
process sees (``tests.support.small_disk``); operator commands run inside the
same mount namespace. A chat call is held open at the upstream; the test
fills the disk; the upstream answers. The settlement of that call cannot be
written, so the server keeps trying while the disk is full: meanwhile
``/readyz`` is 503 (``/healthz`` stays 200: the process is alive), and a new
request is refused with 503 ``storage_unavailable``, ``retryable: true``,
having written nothing (not even its Idempotency-Key). The disk is freed:
the held call settles and answers 200, charged once; the refused request,
sent again with the same key, runs once; ``batchyard audit`` is clean and
``batchyard holds list`` finds nothing stranded.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.deferred_batches import chat
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, worker_config
from tests.support.server import free_port
from tests.support.small_disk import SmallDisk
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))


@pytest.fixture
def small_disk(tmp_path: Path) -> SmallDisk:
    reason = SmallDisk.works()
    assert reason is None, f"cannot mount a private tmpfs here: {reason}"
    return SmallDisk(tmp_path / "small-disk", size_mb=16)


async def test_a_full_disk_answers_503_and_strands_nothing(
    tmp_path: Path, small_disk: SmallDisk, workers: Workers
) -> None:
    with FakeUpstream() as up:
        config = worker_config(tmp_path / "config.yaml", upstream=up.base_url)
        url = f"sqlite:///{small_disk.path / 'batchyard.db'}"
        port = free_port()
        server = workers.start(
            config=config,
            database_url=url,
            name="serve",
            command="serve",
            args=("--port", str(port)),
            prefix=small_disk.prefix,
        )
        small_disk.pid = server.pid
        base = f"http://127.0.0.1:{port}"

        def operator(*args: str) -> subprocess.CompletedProcess[str]:
            env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
            env.update(
                BATCHYARD_CONFIG=str(config),
                BATCHYARD_DATABASE_URL=url,
                BATCHYARD_HOME=str(tmp_path / "operator"),
            )
            return subprocess.run(
                [*small_disk.enter(), BATCHYARD, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=HANG_S,
                check=False,
            )

        async def ready() -> bool:
            try:
                async with httpx.AsyncClient(base_url=base) as c:
                    return (await c.get("/readyz")).status_code == 200
            except httpx.TransportError:
                return False

        await workers.until(ready, "serve is ready")
        made = operator("keys", "create", "--org", "acme")
        assert made.returncode == 0, made.stderr
        headers = {"Authorization": f"Bearer {made.stdout.strip().splitlines()[-1]}"}
        assert operator("credit", "add", "--org", "acme", "1").returncode == 0
        up.hold(after=0)
        async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
            body = {**chat("a call the disk fills under"), "max_tokens": 8}
            call = asyncio.create_task(
                http.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={**headers, "Idempotency-Key": "chat-1"},
                )
            )
            await workers.until(lambda: up.held == 1 or call.done(), "the chat call is in flight")
            assert not call.done(), call.result().text
            assert small_disk.fill() > 0
            up.release()  # the model answers; its settlement cannot be written
            await workers.until(
                lambda: "write_retry" in server.output(), "the server retries the settlement"
            )
            unready = await http.get("/readyz")
            alive = await http.get("/healthz")
            project = {"name": "made while the disk is full"}
            refused = await http.post(
                "/v1/projects", json=project, headers={**headers, "Idempotency-Key": "project-1"}
            )
            assert not call.done()  # still waiting for the store, not failed

            small_disk.free()
            answer = await call
            await workers.until(ready, "serve is ready again")
            again = await http.post(
                "/v1/projects", json=project, headers={**headers, "Idempotency-Key": "project-1"}
            )
            replayed = await http.post(
                "/v1/projects", json=project, headers={**headers, "Idempotency-Key": "project-1"}
            )
            replay = await http.post(
                "/v1/chat/completions", json=body, headers={**headers, "Idempotency-Key": "chat-1"}
            )
            account = (await http.get("/v1/account", headers=headers)).json()
        audit = operator("audit")
        stranded = operator("holds", "list")

    assert unready.status_code == 503 and unready.json()["status"] == "unready"
    assert unready.json()["checks"]["store"]["ok"] is False
    assert alive.status_code == 200
    assert refused.status_code == 503, refused.text
    err = refused.json()["error"]
    assert err["code"] == "storage_unavailable" and err["retryable"] is True
    assert refused.headers.get("retry-after")

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "echo: a call the disk fills under"
    assert replay.status_code == 200 and replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["id"] == answer.json()["id"]
    assert up.arrived == ["a call the disk fills under"]  # sent once; the retry was a replay
    assert again.status_code == 201, again.text  # the refused request had left no claim
    assert replayed.headers.get("idempotent-replayed") == "true"
    assert replayed.json()["id"] == again.json()["id"]
    assert account["credit"]["held"] == "0" and account["credit"]["balance"] != "1"
    assert audit.returncode == 0, audit.stderr
    assert stranded.returncode == 0 and "no stranded holds" in stranded.stderr
