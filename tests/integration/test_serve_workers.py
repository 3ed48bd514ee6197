"""``batchyard serve --workers 2`` as an operator starts it: two API processes on one port.

Real processes on a real PostgreSQL: requests on fresh connections until
``/metrics`` shows both processes answered (its per-process series carry each
one's pid), the counts of both summed in one scrape, then SIGTERM to the
parent and every process gone. SQLite is refused with one clear line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, text

from tests.support.server import free_port
from tests.support.waits import HANG_S

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))
PG_ADMIN = os.environ.get(
    "BATCHYARD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "BATCHYARD_HOME": str(tmp / "home")}
    for name in ("BATCHYARD_CONFIG", "BATCHYARD_DATABASE_URL", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    return env


@pytest.fixture
def pg_database():
    name = f"by_test_workers_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _healthz(base: str) -> int:
    # A fresh connection each time, so the kernel hands it to either process.
    with httpx.Client(base_url=base, timeout=HANG_S) as http:
        return http.get("/healthz").status_code


def _scrape(base: str) -> dict[str, list]:
    families = text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=HANG_S).text)
    return {f.name: list(f.samples) for f in families}


def test_two_api_processes_share_the_port_and_sigterm_stops_them_all(pg_database, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            *(BATCHYARD, "serve", "--workers", "2", "--port", str(port)),
            *("--database", pg_database, "--log-level", "warning", "--grace", "5"),
        ],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if _healthz(base) == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "hung: serve --workers 2 never became healthy"
            time.sleep(0.2)

        # Rounds of 40 requests on fresh connections until both processes have answered:
        # the second may still be starting when the first answers (a loaded machine).
        sent = 1
        pids: dict[str, float] = {}
        deadline = time.monotonic() + HANG_S
        with ThreadPoolExecutor(8) as pool:
            while len(pids) < 2:
                assert time.monotonic() < deadline, f"hung: one process answered all: {pids}"
                assert all(s == 200 for s in pool.map(_healthz, [base] * 40))
                sent += 40
                served = _scrape(base)["batchyard_process_http_requests"]
                pids = {s.labels["pid"]: s.value for s in served if s.value > 0}
        assert len(pids) == 2, pids

        metrics = _scrape(base)
        healthz = sum(
            s.value
            for s in metrics["batchyard_http_requests"]
            if s.name == "batchyard_http_requests_total" and s.labels["route"] == "/healthz"
        )
        assert healthz == sent  # both processes' counts, summed in one scrape
        process_pids = {int(p) for p in pids}
        assert proc.pid not in process_pids

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, out
        assert "Traceback" not in out, out
        for pid in process_pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_more_than_one_process_on_sqlite_is_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [
            *(BATCHYARD, "serve", "--workers", "2", "--port", str(free_port())),
            *("--database", f"sqlite:///{tmp_path / 'one.db'}"),
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 1
    assert "needs PostgreSQL" in done.stderr and "Traceback" not in done.stderr
