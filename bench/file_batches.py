"""A 50,000-line OpenAI batch file through batchyard, against a bare httpx loop in the same run.

An instant OpenAI-compatible upstream (``tests/support/fake_upstream``, in a
process of its own) answers both. ``batchyard serve`` runs as a real
subprocess (uvicorn, its in-process workers, SQLite with ``synchronous=FULL``
in a temp dir, one ``openai_http`` route to the upstream whose only limit is
its concurrency). The bare loop sends the same number of requests at that
concurrency straight to the upstream; then the file is uploaded
(``POST /v1/files``), a batch created over it, and polled until it ends.
With ``--follow-rounds P``, P more pairs of batches over the same file follow:
one read while it runs through ``/finished`` (a page every 0.2 s, as a client
following it would), one not, the order alternating; reported is the median
of each pair's lines/s ratio, and whether the follower read every line once,
as the output file holds it.
Reported: lines per second from creation to the end against the bare loop's
rate (target ≥ 0.5), the upload's own rate, the server's CPU time per line
from creation to the end, and the server's peak resident memory (``VmHWM``,
target ≤ 256 MB). Every line must be answered once and
charged: the batch's charge equals the sum of its lines' charges, nothing
is held, and the ledger audit is clean.

    python bench/file_batches.py [--lines N] [--concurrency C] [--follow-rounds P]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from bench.dispatch import UPSTREAM, cpu_seconds, drive, free_port, wait_healthy  # noqa: E402

from batchyard.core.accounts import Scope  # noqa: E402
from batchyard.core.clock import SystemClock  # noqa: E402
from batchyard.core.money import parse_money, to_ticks  # noqa: E402
from batchyard.store import accounts, ledger  # noqa: E402
from batchyard.store.database import Database  # noqa: E402

console = Console()


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (Linux ``VmHWM``), in MB; 0 where /proc is missing."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def write_file(path: Path, n: int) -> int:
    with path.open("w") as f:
        for i in range(n):
            line = {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "bench-model",
                    "messages": [{"role": "user", "content": f"Say ok {i}."}],
                    "max_tokens": 4,
                },
            }
            f.write(json.dumps(line) + "\n")
    return path.stat().st_size


def run_batch(
    http: httpx.Client, file_id: str, *, follow: bool
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Create a batch over the file and wait for its end; with ``follow``, read it as it runs.

    The follower reads ``/finished`` from its cursor as a client following the
    batch would, a page of up to 1,000 lines every 0.2 s; what it read is returned.
    """
    batch = http.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ).json()
    read: list[dict[str, Any]] = []
    cursor = "0"
    while True:
        if follow:
            page = http.get(
                f"/v1/batches/{batch['id']}/finished", params={"after": cursor, "limit": 1000}
            ).json()
            read += page["data"]
            cursor = page["cursor"]
            if page["has_more"]:
                continue
            if page["ended"]:
                break
        else:
            batch = http.get(f"/v1/batches/{batch['id']}").json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
        time.sleep(0.2)
    return http.get(f"/v1/batches/{batch['id']}").json(), read


def follow_rounds(
    http: httpx.Client, file_id: str, pairs: int, first_out: list[str]
) -> tuple[list[float], bool] | None:
    """``pairs`` pairs of batches over the same file, followed and not, order alternating.

    Each pair's ratio is the followed batch's lines/s over the other's; and
    whether every follower read each line once, exactly as the output file holds it.
    """
    if pairs <= 0:
        return None
    expected = sorted(json.loads(x)["custom_id"] for x in first_out)
    ratios, whole = [], True
    for i in range(pairs):
        seconds: dict[bool, float] = {}
        for follow in (True, False) if i % 2 else (False, True):
            t0 = time.perf_counter()
            batch, read = run_batch(http, file_id, follow=follow)
            seconds[follow] = time.perf_counter() - t0
            if follow:
                out = http.get(f"/v1/files/{batch['output_file_id']}/content").text
                final = sorted(
                    (json.loads(x) for x in out.splitlines()), key=lambda x: x["custom_id"]
                )
                got = sorted(read, key=lambda x: x["custom_id"])
                whole = whole and [x["custom_id"] for x in got] == expected
                # The same lines, field for field, but for the ids each batch gives its requests.
                whole = whole and [x["response"]["body"]["choices"] for x in got] == [
                    x["response"]["body"]["choices"] for x in final
                ]
        ratios.append(seconds[False] / seconds[True])
    return ratios, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument(
        "--follow-rounds",
        type=int,
        default=0,
        help="then this many pairs of batches, one read while it runs (/finished), one not",
    )
    args = ap.parse_args()
    n, c = args.lines, args.concurrency

    tmp = Path(tempfile.mkdtemp(prefix="batchyard-bench-files-"))
    env = {
        **os.environ,
        "BATCHYARD_HOME": str(tmp),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
    }
    for name in ("BATCHYARD_DATABASE_URL", "BATCHYARD_CONFIG", "BATCHYARD_LIMITER_URL"):
        env.pop(name, None)
    upstream = subprocess.Popen(
        [sys.executable, "-c", UPSTREAM], env=env, stdout=subprocess.PIPE, text=True
    )
    assert upstream.stdout is not None
    up_url = f"http://127.0.0.1:{int(upstream.stdout.readline())}/v1"

    db_url = f"sqlite:///{tmp / 'bench.db'}"
    config = {
        "database_url": db_url,
        "models": [
            {
                "id": "bench-model",
                "input_per_mtok": "1",
                "output_per_mtok": "2",
                "context_window": 8192,
            }
        ],
        "routes": [
            {
                "id": "instant",
                "model": "bench-model",
                "engine": "openai_http",
                "base_url": up_url,
                "upstream_model": "fake",
                "concurrency": c,
            }
        ],
        "file_batches": {"poll_s": 0.2},
    }
    cfg = tmp / "bench.yaml"
    cfg.write_text(yaml.safe_dump(config))
    db = Database(db_url, pool_size=1)
    db.migrate()
    now = SystemClock().now()

    def setup(conn):  # type: ignore[no-untyped-def]
        org = accounts.ensure_org(conn, "bench", now)
        _, secret = accounts.create_key(conn, org.id, Scope.INFERENCE, now)
        ledger.top_up(conn, org.id, to_ticks(Decimal("1000000")), now)
        return org.id, secret

    org_id, key = db.transact_sync(setup)
    source = tmp / "requests.jsonl"
    size = write_file(source, n)

    port = free_port()
    serve = ["serve", "--port", str(port), "--config", str(cfg), "--log-level", "warning"]
    server = subprocess.Popen([sys.executable, "-m", "batchyard", *serve], env=env)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"}
    try:
        wait_healthy(base, server)
        asyncio.run(drive(f"{up_url}/chat/completions", max(c, 50), c, {}, False, "wb"))
        bare = asyncio.run(drive(f"{up_url}/chat/completions", n, c, {}, False, "b"))
        with httpx.Client(base_url=base, headers=headers, timeout=600) as http:
            t0 = time.perf_counter()
            with source.open("rb") as f:
                up = http.post(
                    "/v1/files",
                    data={"purpose": "batch"},
                    files={"file": ("requests.jsonl", f, "application/jsonl")},
                )
            upload_s = time.perf_counter() - t0
            up.raise_for_status()
            file_id = up.json()["id"]
            t1, cpu0 = time.perf_counter(), cpu_seconds(server.pid)
            batch, _ = run_batch(http, file_id, follow=False)
            batch_s = time.perf_counter() - t1
            batch_cpu = cpu_seconds(server.pid) - cpu0
            lines_charge = 0
            out = http.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
            for line in out:
                lines_charge += to_ticks(
                    parse_money(json.loads(line)["response"]["body"]["charge"])
                )
            following = follow_rounds(http, file_id, args.follow_rounds, out)
        peak = peak_rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        upstream.terminate()
        upstream.wait(timeout=10)

    problems = db.read_sync(ledger.audit)
    held = db.read_sync(lambda conn: ledger.balance(conn, org_id).held)
    db.close()
    rate = n / batch_s
    table = Table(title=f"{n} lines ({size / 1e6:.1f} MB) at concurrency {c}")
    for col in ("path", "lines/s", "seconds"):
        table.add_column(col, justify="right" if col != "path" else "left")
    table.add_row("bare httpx → upstream", f"{bare.rate():,.0f}", f"{bare.seconds:.1f}")
    table.add_row("upload and validate (POST /v1/files)", f"{n / upload_s:,.0f}", f"{upload_s:.1f}")
    table.add_row("batch: created → completed", f"{rate:,.0f}", f"{batch_s:.1f}")
    console.print(table)
    ratio = rate / bare.rate() if bare.rate() else 0.0
    console.print(f"ratio batch / bare: [bold]{ratio:.2f}[/] (target ≥ 0.50)")
    console.print(f"server peak memory: [bold]{peak:.0f} MB[/] (target ≤ 256 MB)")
    if batch_cpu:
        # Less at the mercy of a busy machine than the rates: what each line cost the server.
        console.print(f"server CPU: {batch_cpu * 1000 / n:.2f} ms per line (created → completed)")
    answered = batch["request_counts"]["completed"]
    charge = to_ticks(parse_money(batch["charge"]))
    sound = (
        batch["status"] == "completed"
        and answered == len(out) == n
        and charge == lines_charge
        and held == 0
        and not problems
    )
    mark = "[green]✓[/]" if sound else "[red]✗[/]"
    console.print(
        f"{mark} {answered} of {n} answered once; batch charge {charge} ticks = sum of lines "
        f"{lines_charge}; {held} held; audit {problems if problems else 'clean'}"
    )
    if following is not None:
        ratios, whole = following
        ratios.sort()
        median = ratios[len(ratios) // 2]
        console.print(
            f"followed / not followed, lines/s per pair: median [bold]{median:.2f}[/] "
            f"(range {ratios[0]:.2f}–{ratios[-1]:.2f}, {len(ratios)} pairs, order alternating); "
            + ("every line read once, as the files hold it" if whole else "[red]lines differ[/]")
        )
        sound = sound and whole
    shutil.rmtree(tmp, ignore_errors=True)
    if not sound:
        sys.exit(1)


if __name__ == "__main__":
    main()
