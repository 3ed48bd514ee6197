"""The paced runner against the real server: killed, resumed, retried, and paid once.

Everything here crosses real HTTP to the real decide front door, its tier
limiter, idempotency store and ledger. The answers file is checked line by
line (not through the runner's own reader, which keeps the last line per id
and would hide a duplicate) and the ledger is checked charge by charge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from batchyard.cli.text_runner import command as run_command
from batchyard.client import calls
from batchyard.client.async_client import AsyncClient
from batchyard.client.fleet import TextRunAborted
from batchyard.client.inputs import TextItem
from batchyard.client.keys import request_hash, text_key
from batchyard.client.text_runner import TextRunObserver, run_texts
from batchyard.core import idempotency as idem_rules
from batchyard.core.money import from_ticks, to_ticks
from batchyard.errors import BatchyardError
from batchyard.store import idempotency as idem_store
from batchyard.store import ledger
from batchyard.store.at_rest import open_text
from batchyard.store.idempotency import answer_aad
from batchyard.store.tables import activity, idempotency_keys, ledger_entries
from tests.integration.client.conftest import TIER, TIER_RPM, LiveGateway
from tests.support.accounts import make_account

DECISIONS: list[dict[str, Any]] = [
    {
        "id": "sentiment",
        "question": "How does the writer feel about the product?",
        "outcomes": [
            {"id": "positive", "description": "pleased"},
            {"id": "negative", "description": "unhappy"},
            {"id": "neutral", "description": "neither"},
        ],
    },
    {
        "id": "topic",
        "question": "What is the comment about?",
        "outcomes": [{"id": "battery"}, {"id": "screen"}, {"id": "price"}],
    },
]
_MOODS = ["positive", "negative", "neutral"]
_TOPICS = ["battery", "screen", "price"]


def texts(n: int, prefix: str = "t") -> list[TextItem]:
    return [
        TextItem(
            f"{prefix}{i:03d}",
            f"Comment {i}: the {_TOPICS[i % 3]} is what I noticed, and I feel {_MOODS[i % 5 % 3]}.",
        )
        for i in range(n)
    ]


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def ledger_view(gw: LiveGateway) -> dict[str, Any]:
    """Charges per decision id, the saved responses per key, and the settled total."""
    org = gw.account.org_id

    def read(conn: Any) -> dict[str, Any]:
        charges = Counter(
            r.ref
            for r in conn.execute(
                select(activity.c.ref).where(activity.c.org_id == org, activity.c.kind == "charge")
            )
        )
        saved = {
            # Saved answers are sealed at rest; the store opens them.
            r.key: json.loads(open_text(conn, r.response, answer_aad(org, r.key)))
            for r in conn.execute(
                select(idempotency_keys.c.key, idempotency_keys.c.response).where(
                    idempotency_keys.c.org_id == org, idempotency_keys.c.state == "done"
                )
            )
        }
        settles = [
            r.amount
            for r in conn.execute(
                select(ledger_entries.c.amount).where(
                    ledger_entries.c.org_id == org, ledger_entries.c.kind == "settle"
                )
            )
        ]
        return {"charges": charges, "saved": saved, "settles": settles}

    return gw.service.db.read_sync(read)


class StopAfter(TextRunObserver):
    """Counts answers and raises a flag after ``n`` of them, to kill the run there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.answered = 0
        self.reached = asyncio.Event()

    def result(self, item_id: str, answer: Any, error: BatchyardError | None) -> None:
        if answer is not None:
            self.answered += 1
            if self.answered >= self.n:
                self.reached.set()


async def test_killed_run_resumes_and_every_text_is_answered_and_charged_once(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    items = texts(300)
    out = tmp_path / "answers.jsonl"

    # 1. Twice the tier's rate and twice its concurrency, so the server's limiter
    #    answers 429s that the SDK waits out; killed after about a hundred answers.
    #    Answers are held until the server has refused a call: with 32 workers
    #    against 16 slots a refusal is certain, however slowly a loaded machine
    #    answers (a fast one may meet the requests limit first; either is a 429).
    gateway.wire.hold_answers_until_refused()
    stop = StopAfter(100)
    async with gateway.client() as client:
        task = asyncio.create_task(
            run_texts(
                client,
                items,
                DECISIONS,
                model="kettei-core",
                output=out,
                rpm=2 * TIER_RPM,
                concurrency=2 * TIER.max_in_flight,
                observer=stop,
            )
        )
        # No wall-clock bound of its own: a loaded machine answers slowly, and the
        # suite's per-test timeout still stops a run that never gets there.
        await stop.reached.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    first = lines(out)
    assert 100 <= len(first) < 300
    await gateway.wire.quiet()  # the killed run's last requests still finish on the server
    assert gateway.wire.decide_statuses[429] > 0, gateway.wire.decide_statuses
    assert len({r["id"] for r in first}) == len(first)
    killed_429s = gateway.wire.decide_statuses[429]
    # Answered on the server but never written by the killed client: requests in
    # flight at the kill, including those the server held for a concurrency slot
    # (admitted within seconds, so they waited there instead of a 429).
    unrecorded = gateway.wire.decide_statuses[200] - len(first)
    assert 0 <= unrecorded <= 2 * TIER.max_in_flight

    # 2. The same command again, at the account's own pace. A 429 is never a
    #    failure of a text (the runner queues it again), so none was skipped.
    await gateway.wire.reset()
    async with gateway.client() as client:
        summary = await run_texts(client, items, DECISIONS, model="kettei-core", output=out)
    assert summary.aborted is None and summary.failed == 0 and summary.skipped_failed == 0
    assert summary.already_done == len(first)
    assert summary.answered == 300 - len(first)
    assert gateway.wire.decide_statuses[200] == summary.answered
    # Requests in flight at the kill ran to the end on the server; the rerun
    # got exactly those answers back under the same keys (replayed, not run
    # again), and nothing else was replayed. How many there were depends on the
    # machine's speed; that they are the same ones does not.
    assert gateway.wire.replayed == unrecorded

    # 3. A third time: nothing left to send, nothing sent.
    await gateway.wire.reset()
    async with gateway.client() as client:
        again = await run_texts(client, items, DECISIONS, model="kettei-core", output=out)
    assert again.to_send == 0 and again.answered == 0
    assert gateway.wire.decide_statuses == Counter()

    # Every text exactly once in the file, with one key each.
    rows = lines(out)
    assert Counter(r["id"] for r in rows) == Counter({i.id: 1 for i in items})
    keys = {r["id"]: r["key"] for r in rows}
    assert len(set(keys.values())) == 300
    assert not out.with_suffix(".errors.jsonl").exists()

    # Every text charged exactly once: one saved answer per key, one charge per
    # saved answer, no charge without a saved answer, and the money adds up.
    view = ledger_view(gateway)
    decision_ids = {view["saved"][key]["id"] for key in keys.values()}
    assert len(decision_ids) == 300
    assert set(view["charges"]) == decision_ids
    assert set(view["charges"].values()) == {1}
    assert len(view["settles"]) == 300
    file_total = sum((Decimal(r["charge"]) for r in rows), Decimal(0))
    assert file_total == from_ticks(sum(view["settles"]))
    assert killed_429s > 0  # the limit was real: the first run did hit it


def _cli(gw: LiveGateway, *args: str) -> Any:
    """``batchyard run`` in a thread: the server lives in this test's event loop."""
    env = {**gw.env(), "COLUMNS": "400"}  # one line per message, however long the paths
    return asyncio.to_thread(CliRunner().invoke, run_command, list(args), env=env)


def _write_texts(path: Path, items: list[TextItem]) -> Path:
    path.write_text("".join(json.dumps({"id": i.id, "text": i.text}) + "\n" for i in items))
    return path


async def test_retry_failed_resends_only_what_can_succeed(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    items = texts(30)
    # Three texts meet a failing upstream (retryable 502, past the SDK's two
    # retries); one is too long for the model (400, not retryable).
    broken = {items[4].id, items[11].id, items[25].id}
    items = [TextItem(i.id, f"{i.text} [{i.id}]") for i in items]
    items.append(TextItem("huge", "word " * 5000))
    gateway.broken.update(f"[{b}]" for b in broken)
    source = _write_texts(tmp_path / "texts.jsonl", items)
    decisions = tmp_path / "decisions.json"
    decisions.write_text(json.dumps({"decisions": DECISIONS}))
    out = tmp_path / "answers.jsonl"
    args = [str(source), "--decisions", str(decisions), "--model", "kettei-core"]
    args += ["--output", str(out)]

    first = await _cli(gateway, *args)
    assert first.exit_code == 1, first.output
    assert "Answered 27 this run" in first.output
    assert "4 failed" in first.output and "--retry-failed" in first.output
    failed = {r["id"]: r for r in lines(out.with_suffix(".errors.jsonl"))}
    assert set(failed) == broken | {"huge"}
    assert {failed[b]["code"] for b in broken} == {"upstream_error"}
    assert all(failed[b]["retryable"] for b in broken)
    assert failed["huge"]["code"] == "context_window_exceeded"
    assert failed["huge"]["retryable"] is False

    # Without the flag a rerun leaves the failures alone and sends nothing.
    await gateway.wire.reset()
    skip = await _cli(gateway, *args)
    assert skip.exit_code == 0, skip.output
    assert "4 failed before" in skip.output
    assert gateway.wire.decide_statuses == Counter()

    # The upstream recovers: --retry-failed sends the retryable ones with their
    # own keys, and not the text that would fail the same way again.
    gateway.broken.clear()
    await gateway.wire.reset()
    retry = await _cli(gateway, *args, "--retry-failed")
    assert retry.exit_code == 0, retry.output
    assert "Answered 3 this run" in retry.output
    assert gateway.wire.decide_statuses[200] == 3
    assert set(gateway.wire.decide_statuses) <= {200, 429}
    rows = lines(out)
    assert Counter(r["id"] for r in rows) == Counter({i.id: 1 for i in items if i.id != "huge"})
    left = lines(out.with_suffix(".errors.jsonl"))
    assert [r["id"] for r in left] == ["huge"]

    view = ledger_view(gateway)
    assert len(view["settles"]) == 30 and set(view["charges"].values()) == {1}


async def test_changed_decisions_refuse_the_old_output_and_run_anew_elsewhere(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    items = texts(10)
    source = _write_texts(tmp_path / "texts.jsonl", items)
    decisions = tmp_path / "decisions.json"
    decisions.write_text(json.dumps(DECISIONS))
    out = tmp_path / "answers.jsonl"
    base = [str(source), "--decisions", str(decisions), "--model", "kettei-core"]
    done = await _cli(gateway, *base, "--output", str(out))
    assert done.exit_code == 0, done.output
    before = out.read_bytes()

    changed = [*DECISIONS[:1], {**DECISIONS[1], "question": "Which part is discussed?"}]
    decisions.write_text(json.dumps(changed))
    await gateway.wire.reset()
    refused = await _cli(gateway, *base, "--output", str(out))
    assert refused.exit_code == 1
    assert "different decision set" in refused.output
    assert "another --output" in refused.output
    assert out.read_bytes() == before
    assert gateway.wire.statuses == Counter()  # refused before a single request

    # In a new file the changed questions get new keys by themselves: no 409
    # idempotency_conflict, and each text is run (and paid) for the new set.
    new_out = tmp_path / "answers-v2.jsonl"
    fresh = await _cli(gateway, *base, "--output", str(new_out))
    assert fresh.exit_code == 0, fresh.output
    old_keys = {r["key"] for r in lines(out)}
    new_keys = {r["key"] for r in lines(new_out)}
    assert len(new_keys) == 10 and not old_keys & new_keys
    view = ledger_view(gateway)
    assert len(view["settles"]) == 20 and set(view["charges"].values()) == {1}


async def test_out_of_credit_stops_and_after_buying_credit_the_same_command_finishes(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    items = texts(20, prefix="p")
    out = tmp_path / "answers.jsonl"
    async with gateway.client() as client:
        est = await client.estimate(model="kettei-core", decisions=DECISIONS, text=items[0].text)
    # Enough for a few holds at the quoted maximum, not for twenty texts.
    poor = make_account(gateway.service, "poor", credit=str(Decimal(est["max_cost"]) * 3), tier=1)
    async with AsyncClient(gateway.base_url, poor.key) as client:
        with pytest.raises(TextRunAborted) as stopped:
            await run_texts(
                client, items, DECISIONS, model="kettei-core", output=out, yes=True, concurrency=4
            )
    assert stopped.value.error.code == "insufficient_credit"
    answered = {r["id"] for r in lines(out)}
    assert 0 < len(answered) < 20

    # decide.md says a 402 is saved under its key like an answer; this
    # server sends it as retryable and keeps nothing. Save one by hand, as a
    # server that keeps them would have, to see the rerun get past it too.
    refused = next(i for i in items if i.id not in answered)
    body = calls.decide_body(
        model="kettei-core",
        decisions=DECISIONS,  # type: ignore[arg-type]
        input={"text": refused.text},
    )
    key = text_key(refused.id, request_hash(DECISIONS, "kettei-core", 64))  # type: ignore[arg-type]
    saved_402 = json.dumps(
        {"error": {"code": "insufficient_credit", "message": "buy credit", "retryable": False}}
    )

    def buy_credit_with_a_saved_402(conn: Any) -> None:
        now = gateway.service.clock.now()
        fp = idem_rules.fingerprint("POST", "/v1/decide", body)
        assert idem_store.begin(conn, poor.org_id, key, fp, now, timedelta(hours=24)) is None
        idem_store.finish(conn, poor.org_id, key, 402, saved_402)
        ledger.top_up(conn, poor.org_id, to_ticks(Decimal(5)), now)

    gateway.service.db.transact_sync(buy_credit_with_a_saved_402)
    await gateway.wire.reset()
    async with AsyncClient(gateway.base_url, poor.key) as client:
        rest = await run_texts(client, items, DECISIONS, model="kettei-core", output=out)
    assert rest.failed == 0 and rest.aborted is None
    assert rest.already_done == len(answered) and rest.answered == 20 - len(answered)
    rows = lines(out)
    assert Counter(r["id"] for r in rows) == Counter({i.id: 1 for i in items})
    # The saved 402 was replayed once; the text went again under its next key.
    assert gateway.wire.decide_statuses[402] == 1 and gateway.wire.replayed == 1
    keys = {r["id"]: r["key"] for r in rows}
    assert keys[refused.id] == f"{key}-rw1"
    assert sum(k.endswith("-rw1") for k in keys.values()) == 1

    def charges(conn: Any) -> Counter[str]:
        q = select(activity.c.ref).where(
            activity.c.org_id == poor.org_id, activity.c.kind == "charge"
        )
        return Counter(r.ref for r in conn.execute(q))

    paid = gateway.service.db.read_sync(charges)
    assert len(paid) == 20 and set(paid.values()) == {1}


async def test_estimate_flag_prices_the_run_and_sends_no_decision(
    gateway: LiveGateway, tmp_path: Path
) -> None:
    source = _write_texts(tmp_path / "texts.jsonl", texts(30))
    decisions = tmp_path / "decisions.json"
    decisions.write_text(json.dumps(DECISIONS))
    out = tmp_path / "answers.jsonl"
    args = [str(source), "--decisions", str(decisions), "--model", "kettei-core"]
    result = await _cli(gateway, *args, "--output", str(out), "--estimate")
    assert result.exit_code == 0, result.output
    assert "30 texts to send" in result.output and "at most $" in result.output
    assert f"Pace: {TIER_RPM} requests/min (account limits)" in result.output
    assert gateway.wire.statuses[200] > 0  # the account and the estimates
    assert gateway.wire.decide_statuses == Counter()
    assert not out.exists() and not out.with_name(out.name + ".meta.json").exists()
    assert ledger_view(gateway)["settles"] == []
