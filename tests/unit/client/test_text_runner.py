"""run_texts against the fake gateway over real HTTP: resume, crash, errors, refusals."""

from __future__ import annotations

import asyncio
import copy
import json
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from batchyard.client import AsyncClient
from batchyard.client.fleet import TextRunAborted
from batchyard.client.inputs import InputError, TextItem
from batchyard.client.text_runner import (
    CreditShortfall,
    TextRunEstimate,
    TextRunObserver,
    TextRunRefused,
    TextRunSummary,
    run_texts,
)
from batchyard.errors import BatchyardError
from tests.support.fake_gateway import DECISIONS, FakeGateway, read_lines


def texts(n: int, start: int = 0) -> list[TextItem]:
    return [TextItem(f"c{i}", f"comment number {i} sentiment=negative") for i in range(start, n)]


class Capture(TextRunObserver):
    def __init__(self, stop_after: int | None = None) -> None:
        self.estimate: TextRunEstimate | None = None
        self.results: list[tuple[str, bool]] = []
        self.reached = asyncio.Event()
        self.stop_after = stop_after

    def planned(self, estimate: TextRunEstimate, summary: TextRunSummary) -> None:
        self.estimate = estimate

    def result(self, item_id: str, answer: Any, error: BatchyardError | None) -> None:
        self.results.append((item_id, error is None))
        if self.stop_after is not None and len(self.results) >= self.stop_after:
            self.reached.set()


async def run(gw: FakeGateway, items: list[TextItem], out: Path, **kw: Any) -> TextRunSummary:
    async with AsyncClient(gw.base_url, gw.api_key) as client:
        return await run_texts(
            client,
            items,
            kw.pop("decisions", DECISIONS),
            model=kw.pop("model", "kettei-core"),
            output=out,
            **kw,
        )


async def test_answers_every_text_with_its_key_and_records_the_decision_set(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    seen = Capture()
    summary = await run(gateway, texts(12), out, observer=seen)
    lines = read_lines(out)
    assert sorted(r["id"] for r in lines) == sorted(f"c{i}" for i in range(12))
    row = lines[0]
    assert set(row) == {"id", "answers", "usage", "charge", "fallback", "key"}
    assert row["answers"][0] == {
        "decision": "sentiment",
        "outcome": "negative",
        "probabilities": row["answers"][0]["probabilities"],
    }
    assert row["key"].startswith(row["id"] + "-")
    keys = {r.key for r in gateway.decide_requests()}
    assert keys == {r["key"] for r in lines}
    meta = json.loads((tmp_path / "answers.jsonl.meta.json").read_text())
    assert meta["model"] == "kettei-core" and len(meta["decision_set_hash"]) == 16
    assert summary.answered == 12 and summary.failed == 0
    assert summary.spend == sum(Decimal(r["charge"]) for r in lines) > 0
    assert not (tmp_path / "answers.errors.jsonl").exists()
    assert seen.estimate is not None and seen.estimate.sampled == 12
    assert seen.estimate.max_cost is not None and seen.estimate.max_cost > summary.spend
    assert seen.estimate.pace_source == "account limits"


async def test_rerun_skips_ids_already_answered(gateway: FakeGateway, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    await run(gateway, texts(5), out)
    before = len(gateway.decide_requests())
    summary = await run(gateway, texts(8), out)
    sent = gateway.decide_requests()[before:]
    assert sorted(r.body["input"]["text"].split()[2] for r in sent) == ["5", "6", "7"]
    assert (summary.already_done, summary.answered) == (5, 3)
    assert len(read_lines(out)) == 8


async def test_crash_mid_run_then_rerun_answers_every_id_exactly_once(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    gateway.latency = 0.05
    out = tmp_path / "answers.jsonl"
    seen = Capture(stop_after=8)
    async with AsyncClient(gateway.base_url, gateway.api_key) as client:
        task = asyncio.create_task(
            run_texts(
                client,
                texts(40),
                DECISIONS,
                model="kettei-core",
                output=out,  # type: ignore[arg-type]
                concurrency=6,
                observer=seen,
            )
        )
        await seen.reached.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    written = len(read_lines(out))
    assert 8 <= written < 40
    summary = await run(gateway, texts(40), out, concurrency=6)
    ids = [r["id"] for r in read_lines(out)]
    assert sorted(ids) == sorted(f"c{i}" for i in range(40))
    assert Counter(ids).most_common(1)[0][1] == 1
    assert summary.already_done == written
    # The texts in flight at the crash were answered from saved responses: charged once.
    assert set(gateway.charges.values()) == {1}


async def test_failures_go_to_the_errors_file_and_retry_failed_resends_the_right_ones(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    errors = tmp_path / "answers.errors.jsonl"
    gateway.fail_texts["boom"] = (503, "service_unavailable", True)
    items = [*texts(3), TextItem("flaky", "boom goes the server"), TextItem("long", "w " * 3000)]
    first = await run(gateway, items, out)
    assert (first.answered, first.failed) == (3, 2)
    failed = {r["id"]: r for r in read_lines(errors)}
    assert failed["flaky"]["retryable"] is True and failed["flaky"]["code"] == "service_unavailable"
    assert failed["long"] == {
        **failed["long"],
        "code": "context_window_exceeded",
        "retryable": False,
    }

    # A plain rerun sends nothing for them.
    n = len(gateway.decide_requests())
    again = await run(gateway, items, out)
    assert again.skipped_failed == 2 and len(gateway.decide_requests()) == n

    # --retry-failed: the retryable one goes again with the same key; the other would fail again.
    gateway.fail_texts.clear()
    retried = await run(gateway, items, out, retry_failed=True)
    resent = gateway.decide_requests()[n:]
    assert [r.key for r in resent] == [failed["flaky"]["key"]]
    assert retried.answered == 1 and retried.skipped_failed == 1
    assert [r["id"] for r in read_lines(errors)] == ["long"]

    # Fixed text and a new key version: now it goes, and the errors file empties.
    items[-1] = TextItem("long", "a shorter text")
    fixed = await run(gateway, items, out, retry_failed=True, key_suffix="v2")
    assert fixed.answered == 1
    assert gateway.decide_requests()[-1].key.endswith("-v2")
    assert not errors.exists()
    assert sorted(r["id"] for r in read_lines(out)) == sorted(["c0", "c1", "c2", "flaky", "long"])


async def test_other_decision_set_stops_before_anything_is_sent(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    await run(gateway, texts(2), out)
    n = len(gateway.requests)
    changed = copy.deepcopy(DECISIONS)
    changed[1]["outcomes"].append({"id": "unsure"})
    with pytest.raises(InputError, match="different decision set"):
        await run(gateway, texts(2), out, decisions=changed)
    with pytest.raises(InputError, match="different model"):
        await run(gateway, texts(2), out, model="kettei-dumb")
    (tmp_path / "answers.jsonl.meta.json").unlink()
    with pytest.raises(InputError, match=r"no answers\.jsonl\.meta\.json"):
        await run(gateway, texts(2), out)
    assert len(gateway.requests) == n


async def test_decisions_the_server_refuses_stop_at_the_free_estimate(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    with pytest.raises(TextRunRefused, match="unknown_model"):
        await run(gateway, texts(3), tmp_path / "a.jsonl", model="no-such-model")
    assert gateway.decide_requests() == []


async def test_refuses_when_credit_will_not_cover_the_estimate(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    gateway.credit = Decimal("0.00003")
    out = tmp_path / "answers.jsonl"
    with pytest.raises(CreditShortfall) as info:
        await run(gateway, texts(20), out)
    assert info.value.estimate.credit_available == Decimal("0.00003")
    assert gateway.decide_requests() == []

    # --yes starts anyway; the 402 stops the run instead of failing every text.
    with pytest.raises(TextRunAborted) as stopped:
        await run(gateway, texts(20), out, yes=True, concurrency=1)
    summary = stopped.value.summary
    assert stopped.value.error.code == "insufficient_credit"
    assert 0 < summary.answered < 20 and summary.failed == 0
    assert not (tmp_path / "answers.errors.jsonl").exists()

    gateway.credit = Decimal("10")
    rest = await run(gateway, texts(20), out)
    assert rest.already_done + rest.answered == 20
    assert len(read_lines(out)) == 20


async def test_fallback_answers_are_flagged_and_resent_with_a_new_key(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    gateway.warming.add("kettei-ft")
    first = await run(gateway, texts(3), out, model="kettei-ft")
    assert first.fallback_ids == ["c0", "c1", "c2"]
    gateway.warming.clear()
    assert (await run(gateway, texts(3), out, model="kettei-ft")).fallback_ids == ["c0", "c1", "c2"]
    again = await run(gateway, texts(3), out, model="kettei-ft", resend_fallbacks=True)
    assert again.answered == 3 and again.fallback_ids == []
    lines = read_lines(out)
    assert len(lines) == 6
    last = {r["id"]: r for r in lines}
    assert all(r["fallback"] is None and r["key"].endswith("-rw1") for r in last.values())


async def test_a_key_that_cannot_read_the_account_runs_at_the_default_pace(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    gateway.scope = "inference"
    seen = Capture()
    summary = await run(gateway, texts(1), tmp_path / "a.jsonl", observer=seen)
    assert summary.answered == 1
    assert seen.estimate is not None
    assert (seen.estimate.rpm, seen.estimate.pace_source) == (30, "tier-0 default")
    assert seen.estimate.credit_available is None


async def test_a_torn_last_line_from_a_crash_is_dropped_and_rewritten(
    gateway: FakeGateway, tmp_path: Path
) -> None:
    out = tmp_path / "answers.jsonl"
    await run(gateway, texts(2), out)
    with out.open("a") as fh:
        fh.write('{"id": "c2", "answ')
    summary = await run(gateway, texts(3), out)
    assert summary.answered == 1
    assert [r["id"] for r in read_lines(out)][-1] == "c2"


async def test_steady_pace_uses_the_limit_without_a_single_429(tmp_path: Path) -> None:
    with FakeGateway(rpm=1200) as gw:  # 20 a second, enforced per second
        summary = await run(gw, texts(60), tmp_path / "a.jsonl")
        arrivals = sorted(r.at for r in gw.decide_requests())
        assert gw.rate_limited == 0
    assert summary.answered == 60
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) * 60
    assert rate >= 0.98 * 1200, rate


async def test_the_fake_limit_does_refuse_a_burst(tmp_path: Path) -> None:
    """Guards the test above: the same 60 texts sent at once draw 429s."""
    with FakeGateway(rpm=1200) as gw:
        async with AsyncClient(gw.base_url, gw.api_key, max_retries=0) as client:
            results = await asyncio.gather(
                *(
                    client.decide(model="kettei-core", decisions=DECISIONS, text=t.text)  # type: ignore[arg-type]
                    for t in texts(60)
                ),
                return_exceptions=True,
            )
        assert gw.rate_limited > 0
    assert any(isinstance(r, BatchyardError) and r.code == "rate_limited" for r in results)


def test_the_errors_file_appears_only_with_the_first_failure(tmp_path: Path) -> None:
    """docs/how-to/score-texts.md: ``answers.errors.jsonl`` exists only while something failed."""
    from batchyard.client.answers import AnswerFile

    meta = {"decision_set_hash": "0" * 16, "model": "kettei-core"}
    errors = tmp_path / "answers.errors.jsonl"
    with AnswerFile(tmp_path / "answers.jsonl").open(meta) as f:
        f.write_answer({"id": "c1", "answers": []})
        f.sync()
        assert not errors.exists(), "an errors file during a run with no failures"
        f.write_error({"id": "c2", "code": "upstream_error", "retryable": True})
        assert errors.exists()
    assert [json.loads(x)["id"] for x in errors.read_text().splitlines()] == ["c2"]
    with AnswerFile(tmp_path / "answers.jsonl").open(meta) as f:
        f.write_answer({"id": "c2", "answers": []})
    assert not errors.exists(), "answered since: the errors file goes"
