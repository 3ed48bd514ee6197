"""A 2,000-line file batch on PostgreSQL whose worker is SIGKILLed three times.

The batch runs on real ``batchyard worker`` processes whose route calls a
fake upstream over loopback. Three times, the upstream stops answering after a
few hundred more lines, holding the next calls open; once the worker has a
full set of calls in flight it is killed with SIGKILL (no ``finally`` block,
no cancellation handler) and the next process starts. A last worker finishes
the batch. Then: every line was sent at most once (the upstream counts each
line's text), each line is answered once or ``uncertain``, every call in
flight at a kill is among the uncertain lines and none of them was re-sent,
the batch's one reservation is settled once to exactly the sum of its lines'
charges, and ``batchyard audit`` finds the ledger sound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import select

from batchyard.core.money import parse_money, to_ticks
from batchyard.store import ledger
from batchyard.store.tables import ledger_entries
from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.file_batches import chat_line, create, jsonl, lines_of, upload
from tests.support.processes import Workers, deployment
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S

pytestmark = pytest.mark.postgres

LINES = 2000
CONCURRENCY = 4  # calls in flight per worker when it is killed
BETWEEN_KILLS = 300  # lines answered before the upstream starts holding calls
BATCHYARD = str(Path(sys.executable).with_name("batchyard"))


async def test_three_kills_leave_each_line_answered_once_or_uncertain(
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
            up.hold(after=BETWEEN_KILLS)
            current = workers.start(config=dep.config, database_url=pg_url, name="worker-1")
            acct = make_account(svc, credit="5")
            content = jsonl([chat_line(f"l{i}", f"line {i}", max_tokens=8) for i in range(LINES)])
            f = (await upload(http, acct.headers, content)).json()
            batch = (await create(http, acct.headers, f["id"])).json()
            assert batch["status"] == "in_progress", batch
            in_flight: set[str] = set()
            for kill in range(1, 4):
                await workers.until(
                    lambda: up.held == CONCURRENCY,
                    f"worker {kill} has {CONCURRENCY} calls held",
                )
                before = up.abandoned
                assert current.kill() == -9
                await workers.until(
                    lambda b=before: up.abandoned == b + CONCURRENCY,
                    "the upstream sees the dead worker's calls hang up",
                )
                in_flight |= set(up.arrived) - set(up.answered)
                up.release()
                if kill < 3:
                    up.hold(after=BETWEEN_KILLS)
                current = workers.start(
                    config=dep.config, database_url=pg_url, name=f"worker-{kill + 1}"
                )

            async def ended() -> bool:
                got = await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)
                return got.json()["status"] == "completed"

            await workers.until(ended, "the last worker finishes the batch")
            assert current.terminate() == 0
            done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
            out = await http.get(
                f"/v1/files/{done['output_file_id']}/content", headers=acct.headers
            )
            errors = await http.get(
                f"/v1/files/{done['error_file_id']}/content", headers=acct.headers
            )
            rows = lines_of(svc, batch["id"])
            entries = svc.db.read_sync(
                lambda c: (
                    c.execute(
                        select(ledger_entries.c.kind)
                        .where(
                            ledger_entries.c.org_id == acct.org_id, ledger_entries.c.kind != "topup"
                        )
                        .order_by(ledger_entries.c.id)
                    )
                    .scalars()
                    .all()
                )
            )
            bal = svc.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
            sent = Counter(up.arrived)

    # Each line was sent at most once; the three kills caught 3 × 4 calls in flight.
    assert max(sent.values()) == 1, sent.most_common(3)
    assert len(in_flight) == 3 * CONCURRENCY
    states = Counter(r.state for r in rows)
    assert set(states) <= {"succeeded", "uncertain"}
    assert states["succeeded"] + states["uncertain"] == LINES
    uncertain = {f"line {r.line - 1}" for r in rows if r.state == "uncertain"}
    assert in_flight <= uncertain
    answered = {f"line {r.line - 1}" for r in rows if r.state == "succeeded"}
    assert answered.isdisjoint(uncertain) and answered <= set(up.answered)
    # The files agree: one line per request, each in exactly one of them, in input order.
    out_lines = [json.loads(x) for x in out.text.splitlines()]
    err_lines = [json.loads(x) for x in errors.text.splitlines()]
    assert len(out_lines) == states["succeeded"] and len(err_lines) == states["uncertain"]
    assert {x["error"]["code"] for x in err_lines} == {"uncertain"}
    ids = [x["custom_id"] for x in out_lines]
    assert ids == sorted(ids, key=lambda c: int(c[1:]))
    # Charged once, to the sum of the answered lines' charges, from one reservation.
    line_charges = sum(to_ticks(parse_money(x["response"]["body"]["charge"])) for x in out_lines)
    assert sum(r.charge or 0 for r in rows) == line_charges
    assert to_ticks(parse_money(done["charge"])) == line_charges == bal.settled
    assert entries == ["reserve", "settle", "release"] and bal.held == 0
    audit = subprocess.run(
        [BATCHYARD, "audit", "--database", pg_url],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={"PATH": "/usr/bin:/bin", "BATCHYARD_HOME": str(tmp_path / "audit-home")},
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
