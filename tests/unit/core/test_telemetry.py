"""The metrics seam: what ``MeteredLimiter`` counts, and the reference names what is served."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from batchyard.core.clock import ManualClock
from batchyard.core.limits import InMemoryLimiter, Limit
from batchyard.core.telemetry import MemoryRecorder, MeteredLimiter
from batchyard.engines.protocol import CacheState
from batchyard.service.metrics import PrometheusRecorder
from batchyard.store.backlog import Backlog

DOCS = Path(__file__).resolve().parents[3] / "docs"


async def test_the_metered_limiter_counts_verdicts_but_not_looks_that_spend_nothing():
    clock = ManualClock()
    recorder = MemoryRecorder()
    limiter = MeteredLimiter(InMemoryLimiter(clock), recorder)
    rpm = Limit("rpm", 1.0)
    assert (await limiter.try_acquire("org:o1", [(rpm, 1.0)])).allowed
    assert not (await limiter.try_acquire("org:o1", [(rpm, 1.0)])).allowed
    await limiter.try_acquire("org:o1", [(rpm, 0.0)])  # the answer's x-ratelimit-* look
    await limiter.acquire("route:fake", [(Limit("rpm", 600.0), 1.0)])
    assert (await limiter.occupy("org:o2", 1, 60.0)).token is not None
    assert (await limiter.occupy("org:o2", 1, 60.0)).token is None
    assert dict(recorder.counts) == {
        ("admission", "org", "admitted", ""): 1,
        ("admission", "org", "refused", "rpm"): 1,
        ("admission", "route", "admitted", ""): 1,
        ("admission", "org", "refused", "concurrency"): 1,
    }


def _served() -> set[str]:
    recorder = PrometheusRecorder()
    recorder.http_request("/healthz", "GET", 200, 0.01)
    recorder.model_call("fake", "ok")
    recorder.tokens("fake", 3, 4)
    recorder.charged("chat", Decimal("0.000001"))
    recorder.admission("org", "refused", "rpm")
    recorder.upstream_429("fake", 2.0)
    recorder.leases_recovered("runs", 1)
    recorder.uncertain("runs", 1)
    text = recorder.exposition(Backlog(1, 2, 3, 4, 5), [CacheState("base", 1024, 1)]).decode()
    return {f.name for f in text_string_to_metric_families(text)}


def test_the_reference_lists_exactly_the_metrics_served():
    served = _served()
    page = (DOCS / "reference" / "metrics.md").read_text(encoding="utf-8")
    listed = {
        re.sub(r"_total$", "", m) for m in re.findall(r"^\| `(batchyard_[a-z_0-9]+)`", page, re.M)
    }
    assert listed == served


def test_the_dashboard_reads_only_metrics_that_exist():
    served = _served()
    dashboard = json.loads((DOCS / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {
        re.sub(r"_(total|bucket|count|sum)$", "", name)
        for e in exprs
        for name in re.findall(r"batchyard_[a-z_0-9]+", e)
    }
    assert used and used <= served, used - served
