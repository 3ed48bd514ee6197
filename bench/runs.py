"""How fast is a batch inference run's quote, and how fast does a run go?

Three numbers users feel:

- quoting: rows per second while a run freezes and counts a dataset, beside
  the bare tokenizer counting the same texts in memory (the ratio is the
  share of the tokenizer's speed the quote keeps; target ≥ 0.9);
- the peak memory of the process that quotes (target ≤ 256 MB for a million
  rows): it runs in a subprocess of its own, measured with getrusage;
- rows per second through a run against an instant loopback FakeUpstream
  (quote, confirm, answer, write outputs, settle).

    PYTHONPATH=src python bench/runs.py [--rows N] [--run-rows N]

``--rows 1000000`` is supported; it takes minutes, mostly in the tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from batchyard.app import build_service, run_worker  # noqa: E402
from batchyard.core.clock import SystemClock  # noqa: E402
from batchyard.core.config import load_settings  # noqa: E402
from batchyard.core.ids import new_id  # noqa: E402
from batchyard.core.sections import RunSettings  # noqa: E402
from batchyard.service import Service  # noqa: E402
from batchyard.store import projects as pstore  # noqa: E402
from batchyard.store import runs as rstore  # noqa: E402

_VOCABULARY = (
    "my order arrived late and the box was damaged please refund the shipping cost "
    "I tried to reset my password but the email never came can you help "
    "the invoice shows the wrong address and VAT number for our company account"
)
WORDS = _VOCABULARY.split()
SPEC = {
    "model": {"type": "base", "id": "kettei-core"},
    "mode": {"type": "single_turn"},
    "input": {"type": "field", "field": "text"},
    "output": {"type": "field", "field": "answer"},
    "sampling": {"maxOutputTokens": 16, "samplesPerRow": 1, "temperature": None, "topP": None},
    "filter": None,
}


def texts(n: int, seed: int = 7) -> Iterator[str]:
    """Support-ticket-like texts of 20 to 80 words, the same for a given seed."""
    rng = random.Random(seed)
    for i in range(n):
        yield f"Ticket {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))


def chunks(n: int, size: int = 5000) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts(n):
        batch.append(t)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _service(url: str, **overrides: Any) -> Service:
    svc = build_service(load_settings(database_url=url, **overrides), clock=SystemClock())
    svc.db.migrate()
    return svc


def setup(url: str, rows: int) -> tuple[str, str, str]:
    """An organisation with credit, a project and a dataset of ``rows`` rows."""
    from tests.support.accounts import make_account

    svc = _service(url)
    acct = make_account(svc, "bench", credit="100000")
    now = svc.clock.now()

    def create(c: Any) -> tuple[str, str]:
        p = pstore.create_project(c, acct.org_id, "bench", now)
        return p.id, pstore.create_dataset(c, acct.org_id, p.id, "tickets", "text", now).id

    project, dataset = svc.db.transact_sync(create)
    for batch in chunks(rows):

        def append(c: Any, b: list[str] = batch) -> int:
            return pstore.append_rows(c, dataset, [{"text": t} for t in b], now)

        svc.db.transact_sync(append)
    svc.db.close()
    return acct.org_id, project, dataset


def new_run(svc: Service, org: str, project: str, dataset: str) -> str:
    now = svc.clock.now()
    run_id = new_id("bir", now)
    svc.db.transact_sync(
        lambda c: rstore.create_run(
            c,
            run_id=run_id,
            org_id=org,
            project_id=project,
            dataset_id=dataset,
            spec=SPEC,
            now=now,
        )
    )
    return run_id


def phase_quote(url: str, org: str, project: str, dataset: str) -> dict[str, Any]:
    """In its own process: quote the dataset; report speed and peak memory."""
    svc = _service(url)
    svc.tokenizer(svc.catalog.model("kettei-core"))  # load the vocabulary outside the timing
    run_id = new_run(svc, org, project, dataset)
    start = time.perf_counter()
    asyncio.run(run_worker(svc).run_until_idle())
    elapsed = time.perf_counter() - start
    run = svc.db.transact_sync(lambda c: rstore.load_run(c, run_id))
    svc.db.close()
    return {
        "seconds": elapsed,
        "rows": run.quote_rows,
        "status": run.status,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def bare_tokenizer(rows: int) -> dict[str, Any]:
    """The tokenizer alone over the same texts, already in memory."""
    svc = build_service(load_settings(database_url="sqlite://"), clock=SystemClock())
    tok = svc.tokenizer(svc.catalog.model("kettei-core"))
    spent = 0.0
    for batch in chunks(rows):
        start = time.perf_counter()
        tok.count_batch(batch)
        spent += time.perf_counter() - start
    svc.db.close()
    return {"seconds": spent}


async def _run_through(svc: Service, org: str, project: str, dataset: str) -> dict[str, Any]:
    from batchyard.work.runs.funding import fund

    worker = run_worker(svc)
    run_id = new_run(svc, org, project, dataset)
    start = time.perf_counter()
    await worker.run_until_idle()
    quoted = time.perf_counter()

    def confirm(c: Any) -> None:
        fund(c, rstore.load_run(c, run_id), svc.clock.now(), threshold=None)

    svc.db.transact_sync(confirm)
    await worker.run_until_idle()
    end = time.perf_counter()
    run = svc.db.transact_sync(lambda c: rstore.load_run(c, run_id))
    await svc.engines.aclose()
    return {
        "status": run.status,
        "rows": run.rows_done,
        "quote_s": quoted - start,
        "run_s": end - quoted,
    }


def phase_run(url: str, rows: int, concurrency: int) -> dict[str, Any]:
    from tests.support.fake_upstream import FakeUpstream
    from tests.support.runs import http_catalog

    org, project, dataset = setup(url, rows)
    with FakeUpstream(mode="instant") as up:
        svc = _service(url)
        svc = build_service(
            replace(
                svc.settings,
                catalog=http_catalog(up.base_url),
                runs=RunSettings(concurrency=concurrency),
            ),
            clock=SystemClock(),
        )
        try:
            return asyncio.run(_run_through(svc, org, project, dataset))
        finally:
            svc.db.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=20_000, help="rows to quote (default 20000)")
    ap.add_argument("--run-rows", type=int, default=5_000, help="rows to run (default 5000)")
    ap.add_argument("--concurrency", type=int, default=16, help="calls in flight per run")
    ap.add_argument("--phase", choices=["quote"], help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.phase == "quote":
        print(json.dumps(phase_quote(*json.loads(opts.args))))
        return

    console = Console()
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as tmp:
        url = f"sqlite:///{tmp}/quote.db"
        with console.status(f"writing {opts.rows:,} rows"):
            org, project, dataset = setup(url, opts.rows)
        with console.status("counting with the bare tokenizer"):
            bare = bare_tokenizer(opts.rows)
        with console.status("quoting in a subprocess"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--phase",
                    "quote",
                    "--args",
                    json.dumps([url, org, project, dataset]),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            quote = json.loads(out.stdout.strip().splitlines()[-1])
        with console.status(f"running {opts.run_rows:,} rows against a loopback upstream"):
            run = phase_run(f"sqlite:///{tmp}/run.db", opts.run_rows, opts.concurrency)

    bare_rps = opts.rows / bare["seconds"]
    quote_rps = opts.rows / quote["seconds"]
    table = Table(title=f"batch inference runs ({opts.rows:,} rows quoted)")
    for col in ("measure", "value", "target"):
        table.add_column(col)
    table.add_row("bare tokenizer", f"{bare_rps:,.0f} rows/s", "")
    table.add_row("quote (freeze + count + store)", f"{quote_rps:,.0f} rows/s", "")
    ratio = quote_rps / bare_rps
    table.add_row("quote / bare tokenizer", f"{ratio:.2f}", "≥ 0.90")
    table.add_row(
        "peak memory of the quoting process", f"{quote['peak_rss_mb']:.0f} MB", "≤ 256 MB"
    )
    table.add_row("quote status", f"{quote['status']} ({quote['rows']:,} rows)", "")
    table.add_row(
        f"run against an instant upstream ({run['rows']:,} rows)",
        f"{run['rows'] / run['run_s']:,.0f} rows/s",
        "",
    )
    table.add_row("run status", str(run["status"]), "completed")
    console.print(table)


if __name__ == "__main__":
    main()
