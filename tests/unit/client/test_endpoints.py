"""Every typed method reaches its path, and every state-changing POST carries a key."""

from __future__ import annotations

from typing import Any

import pytest

from batchyard.client import AsyncClient, Client
from tests.support.fake_gateway import DECISIONS, FakeGateway


def _sync_calls(c: Client) -> list[Any]:
    return [
        c.keep_warm("kettei-ft", 30),
        c.chat_completion(
            model="kettei-core", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        ),
        c.create_batch(
            [{"custom_id": "r1", "body": {"model": "m", "messages": []}}], min_discount=90
        ),
        c.get_batch("b/1"),
        c.cancel_batch("b1"),
        c.list_activity(limit="5"),
        c.create_project({"name": "p"}),
        c.get_project("pp.1"),
        c.upload_dataset("pp.1", "rows.jsonl", b'{"text": "x"}\n', fields={"name": "d"}),
        c.dataset_rows("pp.1", "ds.1", cursor="abc"),
        c.create_run("pp.1", {"datasetId": "ds.1"}),
        c.get_run("pp.1", "bir.1"),
        c.confirm_run("pp.1", "bir.1"),
        c.cancel_run("pp.1", "bir.1"),
        c.list_runs("pp.1", status="running"),
    ]


EXPECTED = [
    ("POST", "/v1/models/kettei-ft/keep-warm"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches/b%2F1"),
    ("POST", "/v1/batches/b1/cancel"),
    ("GET", "/v1/activity"),
    ("POST", "/v1/projects"),
    ("GET", "/v1/projects/pp.1"),
    ("POST", "/v1/projects/pp.1/datasets"),
    ("GET", "/v1/projects/pp.1/datasets/ds.1/rows"),
    ("POST", "/v1/projects/pp.1/batch-inference-runs"),
    ("GET", "/v1/projects/pp.1/batch-inference-runs/bir.1"),
    ("POST", "/v1/projects/pp.1/batch-inference-runs/bir.1/confirm"),
    ("POST", "/v1/projects/pp.1/batch-inference-runs/bir.1/cancel"),
    ("GET", "/v1/projects/pp.1/batch-inference-runs"),
]


def test_sync_methods_reach_their_paths_with_keys_on_posts(gateway: FakeGateway) -> None:
    with Client(gateway.base_url, gateway.api_key) as c:
        echoes = _sync_calls(c)
        assert [m["id"] for m in c.list_models()["data"]] == list(gateway.models)
        assert c.get_model("kettei-core")["pricing"]["input_per_mtok"] == "0.05"
        assert c.account()["effective_limits"]["requests_per_minute"] == gateway.rpm
        est = c.estimate(model="kettei-core", decisions=DECISIONS, text="hello")  # type: ignore[arg-type]
        assert est["max_output_tokens"] == 64 and est["max_cost"]
        assert [r["custom_id"] for r in c.batch_results("b1")] == ["b1-0", "b1-1"]
    assert [(e["method"], e["path"]) for e in echoes] == [
        (m, p.replace("%2F", "/")) for m, p in EXPECTED
    ]
    for echo in echoes:
        has_key = echo["idempotency_key"] is not None
        assert has_key == (echo["method"] == "POST"), echo
        if has_key:
            assert 8 <= len(echo["idempotency_key"]) <= 128
    assert echoes[2]["body"] == {
        "min_discount": 90,
        "completion_window": "24h",
        "requests": [{"custom_id": "r1", "body": {"model": "m", "messages": []}}],
    }
    # A dataset is the file itself as the body, as the server reads it, named in the query.
    assert echoes[8]["content_type"] == "application/x-ndjson"
    assert echoes[8]["query"] == {"name": "d"}
    assert echoes[9]["query"] == {"cursor": "abc"}
    assert echoes[14]["query"] == {"status": "running"}
    estimate = next(r for r in gateway.requests if r.path == "/v1/decide/estimate")
    assert estimate.key is None


async def test_async_methods_match_the_sync_ones(gateway: FakeGateway) -> None:
    async with AsyncClient(gateway.base_url, gateway.api_key) as c:
        warm = await c.keep_warm("kettei-ft", 10, idempotency_key="warm-key-1")
        run = await c.create_run("pp.1", {"datasetId": "ds.1"})
        lines = [line async for line in c.batch_results("b2")]
        models = await c.list_models()
    assert (warm["path"], warm["body"], warm["idempotency_key"]) == (
        "/v1/models/kettei-ft/keep-warm",
        {"minutes": 10},
        "warm-key-1",
    )
    assert run["idempotency_key"] and run["path"].endswith("/batch-inference-runs")
    assert [x["custom_id"] for x in lines] == ["b2-0", "b2-1"]
    assert models["object"] == "list"
    for r in gateway.requests:
        assert r.headers.get("authorization") == f"Bearer {gateway.api_key}"


def test_decide_sends_calibration_only_when_chosen() -> None:
    from batchyard.client import calls

    base = {"model": "kettei-core", "decisions": DECISIONS, "input": {"text": "t"}}
    assert "calibration" not in calls.decide_body(**base)  # type: ignore[arg-type]
    chosen = calls.decide_body(**base, calibration="content_free")  # type: ignore[arg-type]
    assert chosen["calibration"] == "content_free"


def test_a_dataset_upload_is_named_after_its_file_and_typed_by_its_extension() -> None:
    from batchyard.client import calls

    call = calls.upload_dataset("pp.1", "data/comments.CSV", b"text\nhi\n", None, None)
    assert call.params == {"name": "comments"}
    assert call.content == (b"text\nhi\n", "text/csv")
    named = calls.upload_dataset("pp.1", "c.parquet", b"", {"name": "n", "kind": "text"}, "k-1")
    assert named.params == {"name": "n", "kind": "text"}
    assert named.idempotency_key == "k-1"
    with pytest.raises(ValueError, match=r"comments\.txt: a dataset file ends in one of"):
        calls.upload_dataset("pp.1", "comments.txt", b"", None, None)
