"""``/metrics`` over real HTTP, read by prometheus-client's own parser.

A few real requests (chat, decide, a batch inference run, one refused by the
tier's limits, one 404) move the counters; a scrape is parsed with
``text_string_to_metric_families`` and every family of the reference must be
there with the counts the requests imply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from decimal import Decimal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from batchyard.core.tiers import DEFAULT_TIERS
from batchyard.engines.scripted import ScriptedEngine
from tests.support.accounts import make_account
from tests.support.runs import Api, fast_runs
from tests.support.server import live_server
from tests.support.waits import HANG_S

FAMILIES = {
    "batchyard_http_requests",
    "batchyard_http_request_duration_seconds",
    "batchyard_process_http_requests",
    "batchyard_model_calls",
    "batchyard_tokens",
    "batchyard_credits_charged",
    "batchyard_limiter_admissions",
    "batchyard_upstream_429",
    "batchyard_upstream_retry_after_seconds",
    "batchyard_leases_recovered",
    "batchyard_items_uncertain",
    "batchyard_work_stuck",
    "batchyard_store_up",
    "batchyard_queue_depth",
    "batchyard_holds_open",
    "batchyard_holds_credits",
}
CHAT = {"model": "kettei-core", "messages": [{"role": "user", "content": "hello there"}]}
DECIDE = {
    "model": "kettei-core",
    "input": {"text": "The battery died after two days."},
    "decisions": [
        {
            "id": "sentiment",
            "question": "How does the writer feel?",
            "outcomes": [{"id": "positive"}, {"id": "negative"}],
        }
    ],
    "max_output_tokens": 16,
}
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}


def scrape(text: str) -> dict[str, list[Sample]]:
    return {f.name: list(f.samples) for f in text_string_to_metric_families(text)}


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_a_scrape_after_real_requests_has_every_family_and_the_counts_moved(make_service):
    # Tier 0 allows one request a minute here, and no queueing: a flood of it is refused.
    tiers = tuple(
        dataclasses.replace(t, requests_per_minute=1, concurrency=1) if t.level == 0 else t
        for t in DEFAULT_TIERS
    )
    svc = make_service(runs=fast_runs(), tiers=tiers, limits_queue_s=0.0)
    engine = ScriptedEngine(
        lambda req: "an answer of five words",
        clock=svc.clock,
        scorer=lambda model, messages, candidates: [0.0] * len(candidates),
    )
    svc.engines.set("embedded", engine)
    acct = make_account(svc, credit="5", tier=1)
    flood = make_account(svc, "flood", credit="5", tier=0)
    async with live_server(svc) as base, httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
        before = scrape((await http.get("/metrics")).text)
        assert set(before) >= FAMILIES, FAMILIES - set(before)

        r = await http.post("/v1/chat/completions", json=CHAT, headers=acct.headers)
        assert r.status_code == 200, r.text
        r = await http.post("/v1/decide", json=DECIDE, headers=acct.headers)
        assert r.status_code == 200, r.text
        api = await Api(http, acct.headers).start()
        ds = await api.upload([{"text": f"row {i}"} for i in range(3)])
        run = (await api.create({**RUN, "datasetId": ds["id"]})).json()
        await api.wait(run["id"], "awaiting_confirmation")
        await api.post(run["id"], "confirm")
        await api.wait(run["id"], "completed")
        assert (await http.get("/v1/no-such-thing", headers=acct.headers)).status_code == 404
        refused = 0
        for _ in range(8):
            r = await http.post("/v1/chat/completions", json=CHAT, headers=flood.headers)
            refused += r.status_code == 429
        assert refused > 0

        response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    after = scrape(response.text)

    http_total = after["batchyard_http_requests"]
    chat = "/v1/chat/completions"
    assert total(http_total, "batchyard_http_requests_total", route=chat, status="200") >= 2
    assert total(http_total, "batchyard_http_requests_total", route=chat, status="429") == refused
    assert total(http_total, "batchyard_http_requests_total", route="/v1/decide") == 1
    assert total(http_total, "batchyard_http_requests_total", route="unmatched") == 1
    runs_route = "/v1/projects/{project_id}/batch-inference-runs"
    assert total(http_total, "batchyard_http_requests_total", route=runs_route) == 1
    latency = after["batchyard_http_request_duration_seconds"]
    assert total(latency, "batchyard_http_request_duration_seconds_count", route=chat) == (
        total(http_total, "batchyard_http_requests_total", route=chat)
    )

    calls = after["batchyard_model_calls"]
    ok = total(calls, "batchyard_model_calls_total", route="embedded", outcome="ok")
    assert ok >= 1 + 1 + 3  # the first chat, decide, the run's three rows
    tokens = after["batchyard_tokens"]
    assert total(tokens, "batchyard_tokens_total", direction="input") > 0
    # Five scripted words for the chat and each of the run's three rows.
    assert total(tokens, "batchyard_tokens_total", direction="output") >= 5 * 4
    credits = after["batchyard_credits_charged"]
    for purpose in ("chat", "decide", "run"):
        charged = total(credits, "batchyard_credits_charged_total", purpose=purpose)
        assert Decimal(str(charged)) > 0, purpose

    verdicts = after["batchyard_limiter_admissions"]
    name = "batchyard_limiter_admissions_total"
    assert total(verdicts, name, scope="org", verdict="refused") > 0
    assert total(verdicts, name, scope="route", verdict="admitted") >= 5

    depth = after["batchyard_queue_depth"]
    assert {s.labels["queue"] for s in depth} == {"run_rows", "deferred_items", "file_batch_lines"}
    assert total(depth, "batchyard_queue_depth", queue="run_rows") == 0  # the run finished
    assert total(after["batchyard_holds_open"], "batchyard_holds_open") == 0
    assert total(after["batchyard_store_up"], "batchyard_store_up") == 1


async def test_a_metrics_token_keeps_the_scrape_to_its_holder(make_service):
    svc = make_service(metrics_token="scrape-secret")
    async with live_server(svc) as base, httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
        assert (await http.get("/metrics")).status_code == 401
        wrong = await http.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
        ok = await http.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
    assert ok.status_code == 200
    assert "batchyard_http_requests_total" in ok.text


@pytest.mark.model
async def test_the_embedded_models_shelf_and_cached_tokens_show_in_the_scrape(make_service):
    """The real embedded model: a chat's own words go to the shelf when another chat
    comes, and a third that starts like the first takes them back as cached tokens."""
    svc = make_service()
    acct = make_account(svc, credit="5")

    def chat(text: str) -> dict[str, object]:
        return {**CHAT, "messages": [{"role": "user", "content": text}], "max_tokens": 2}

    async with live_server(svc) as base, httpx.AsyncClient(base_url=base, timeout=HANG_S) as http:
        before = scrape((await http.get("/metrics")).text)
        for text in (
            "Write a poem about the moon.",
            "Name three rivers.",
            "Write a poem about it.",
        ):
            r = await http.post("/v1/chat/completions", json=chat(text), headers=acct.headers)
            assert r.status_code == 200, r.text
        after = scrape((await http.get("/metrics")).text)
    # Nothing loaded before the first request: no shelf to report.
    assert "batchyard_embedded_shelf_bytes" not in before
    held = total(after["batchyard_embedded_shelf_bytes"], "batchyard_embedded_shelf_bytes")
    shelved = total(after["batchyard_embedded_shelf_prompts"], "batchyard_embedded_shelf_prompts")
    assert held > 0 and shelved >= 1
    assert {s.labels["model"] for s in after["batchyard_embedded_shelf_bytes"]} == {"base"}
    cached = after["batchyard_prompt_tokens_cached"]
    assert total(cached, "batchyard_prompt_tokens_cached_total", route="embedded") > 0
