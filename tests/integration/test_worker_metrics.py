"""A ``batchyard worker`` process serves its own ``/metrics`` (``--metrics-port``).

The worker makes the model calls and settles the charges of a run; the API
process never sees them. This drives a run through a real worker process on
PostgreSQL against a fake upstream over loopback, then scrapes the worker's
port with httpx and reads the text with prometheus-client's own parser.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.accounts import make_account
from tests.support.fake_upstream import FakeUpstream
from tests.support.processes import Workers, deployment
from tests.support.runs import Api
from tests.support.server import free_port
from tests.support.services import ServiceFactory
from tests.support.waits import HANG_S

pytestmark = pytest.mark.postgres

ROWS = [{"text": f"row {i}"} for i in range(6)]
RUN = {
    "model": {"type": "base", "id": "kettei-core"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 8},
}


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def test_a_worker_counts_its_model_calls_and_charges_on_its_own_port(
    tmp_path: Path, pg_url: str, workers: Workers, make_service: ServiceFactory
) -> None:
    port = free_port()
    with FakeUpstream() as up:
        async with deployment(make_service, tmp_path, pg_url, upstream=up) as dep:
            proc = workers.start(
                config=dep.config, database_url=pg_url, args=("--metrics-port", str(port))
            )
            acct = make_account(dep.service, credit="5")
            api = await Api(dep.http, acct.headers).start()
            run_id, _ = await api.confirmed(ROWS, RUN)
            await workers.until(lambda: api.status_in(run_id, "completed"), "the run ends")

            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=HANG_S
            ) as scrape:
                assert (await scrape.get("/healthz")).status_code == 200
                text = (await scrape.get("/metrics")).text
            assert proc.terminate() == 0

    calls = _samples(text, "batchyard_model_calls_total")
    assert calls[(("outcome", "ok"), ("route", "fake"))] == len(ROWS)
    tokens = _samples(text, "batchyard_tokens_total")
    assert tokens[(("direction", "output"), ("route", "fake"))] > 0
    charged = _samples(text, "batchyard_credits_charged_total")
    assert sum(charged.values()) > 0
    # The store's backlog is read by the worker too: nothing is left waiting.
    assert _samples(text, "batchyard_queue_depth")[(("queue", "run_rows"),)] == 0
