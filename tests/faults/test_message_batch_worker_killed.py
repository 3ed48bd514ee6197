"""A Message Batch on PostgreSQL whose worker is SIGKILLed mid-call, then finished by another.

The same machinery as ``test_file_batch_worker_killed`` (a real ``batchyard
worker`` process, a fake upstream over loopback that holds calls open), driven
through Anthropic's dialect. After the kill: every request was sent at most
once, each is ``succeeded`` or ``errored`` with code ``uncertain`` (exactly
the calls that were in flight), the charge equals the sum of what was answered,
and ``batchyard audit`` finds the ledger sound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.file_batches import lines_of
from tests.support.processes import Workers, deployment
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S

pytestmark = pytest.mark.postgres

REQUESTS = 300
CONCURRENCY = 4
BEFORE_KILL = 100
BATCHYARD = str(Path(sys.executable).with_name("batchyard"))
PATH = "/v1/messages/batches"


def request(i: int) -> dict:
    return {
        "custom_id": f"r{i}",
        "params": {
            "model": "kettei-core",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": f"line {i}"}],
        },
    }


async def test_a_kill_leaves_each_request_answered_once_or_uncertain(
    tmp_path: Path, pg_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    with FakeUpstream() as up:
        async with deployment(
            make_service,
            tmp_path,
            pg_url,
            upstream=up,
            route={"concurrency": CONCURRENCY},
            file_batches={"lease_s": 1.5, "poll_s": 0.05, "flush_s": 0.05},
        ) as dep:
            svc, http = dep.service, dep.http
            up.hold(after=BEFORE_KILL)
            first = workers.start(config=dep.config, database_url=pg_url, name="worker-1")
            acct = make_account(svc, credit="5")
            h = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
            created = await http.post(
                PATH, json={"requests": [request(i) for i in range(REQUESTS)]}, headers=h
            )
            assert created.status_code == 200, created.text
            batch = created.json()
            await workers.until(lambda: up.held == CONCURRENCY, "the worker has its calls held")
            before = up.abandoned
            assert first.kill() == -9
            await workers.until(
                lambda: up.abandoned == before + CONCURRENCY,
                "the upstream sees the dead worker's calls hang up",
            )
            in_flight = set(up.arrived) - set(up.answered)
            up.release()
            last = workers.start(config=dep.config, database_url=pg_url, name="worker-2")

            async def ended() -> bool:
                got = await http.get(f"{PATH}/{batch['id']}", headers=h)
                return got.json()["processing_status"] == "ended"

            await workers.until(ended, "the second worker finishes the batch")
            assert last.terminate() == 0
            done = (await http.get(f"{PATH}/{batch['id']}", headers=h)).json()
            results = await http.get(f"{PATH}/{batch['id']}/results", headers=h)
            underneath = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
            rows = lines_of(svc, batch["id"])
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            sent = Counter(up.arrived)

    assert max(sent.values()) == 1, sent.most_common(3)
    assert len(in_flight) == CONCURRENCY
    got = [json.loads(x) for x in results.text.splitlines()]
    assert [x["custom_id"] for x in got] == [f"r{i}" for i in range(REQUESTS)]
    uncertain = {
        x["custom_id"]
        for x in got
        if x["result"]["type"] == "errored" and x["result"]["error"]["error"]["code"] == "uncertain"
    }
    succeeded = {x["custom_id"] for x in got if x["result"]["type"] == "succeeded"}
    assert len(uncertain) + len(succeeded) == REQUESTS
    assert {f"r{t.removeprefix('line ')}" for t in in_flight} == uncertain
    counts = done["request_counts"]
    assert (counts["succeeded"], counts["errored"]) == (len(succeeded), len(uncertain))
    # Charged once, to exactly the answered requests' charges.
    charged = sum(r.charge or 0 for r in rows)
    assert charged == bal.settled > 0 and bal.held == 0
    assert underneath["status"] == "completed"
    audit = subprocess.run(
        [BATCHYARD, "audit", "--database", pg_url],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={"PATH": "/usr/bin:/bin", "BATCHYARD_HOME": str(tmp_path / "audit-home")},
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
