"""Prometheus metrics: the one module that imports ``prometheus_client``.

Under ``serve --workers N`` (``PROMETHEUS_MULTIPROC_DIR`` set before the first import,
``prepare_multiprocess``) each process writes its values to files that a scrape sums;
without it each recorder keeps its own registry, so several services in one process
(tests) do not share counts. docs/reference/metrics.md lists every metric.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from batchyard.core.money import from_ticks
from batchyard.engines.protocol import CacheState
from batchyard.store.backlog import Backlog

__all__ = [
    "CONTENT_TYPE",
    "MULTIPROC_ENV",
    "PrometheusRecorder",
    "mark_dead",
    "multiprocess_dir",
    "prepare_multiprocess",
]

#: The environment variable prometheus_client reads for its multiprocess directory.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# ``*_created`` series double the output and no dashboard reads them (multiprocess mode
# has none), so a single process answers the same families as a fleet.
disable_created_metrics()  # type: ignore[no-untyped-call]


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess(path: Path) -> None:
    """Empty ``path`` and point this process and its children at it (before they import us).

    Files left by an earlier run would add its counts to this one's.
    """
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.environ[MULTIPROC_ENV] = str(path)


def mark_dead(pid: int) -> None:
    """A child process exited: its live gauges no longer count (its counters still do)."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


#: Every counter: ``batchyard_<key>`` on /metrics, its labels, and what it counts.
_COUNTERS = {
    "http_requests": ("route method status", "HTTP answers, by route template, method and status."),
    "model_calls": (
        "route outcome",
        "Engine calls, by route and outcome (ok, upstream_429, or the failure's code).",
    ),
    "tokens": (
        "route direction",
        "Tokens engine calls used, by route and direction (input, output).",
    ),
    "prompt_tokens_cached": (
        "route",
        "Prompt tokens engine calls read from their prompt cache instead of evaluating.",
    ),
    "credits_charged": (
        "purpose",
        "Credits (US dollars) charged when reservations settled, by purpose.",
    ),
    "charges_over_hold": (
        "purpose",
        "Settlements whose charge came to more than their hold (a defect), by purpose.",
    ),
    "limiter_admissions": (
        "scope verdict limit",
        "Limiter verdicts, by key scope (org, route), verdict and the limit that refused.",
    ),
    "upstream_429": ("route", "Upstream 429 answers, by route."),
    "upstream_retry_after_seconds": (
        "route",
        "Seconds of Retry-After the upstream asked a route to wait, by route.",
    ),
    "leases_recovered": (
        "kind",
        "Lapsed leases taken over from a worker that stopped, by kind of work.",
    ),
    "items_uncertain": (
        "kind",
        "Items that became uncertain (sent, then their worker died), by kind of work.",
    ),
    "work_stuck": (
        "kind reason",
        "Work whose progress stood still for stuck_after_s, by kind and why it waits.",
    ),
}


class PrometheusRecorder:
    """Counts the events of ``core.telemetry.Recorder`` as Prometheus metrics."""

    def __init__(self) -> None:
        self.multiprocess = multiprocess_dir() is not None
        # In multiprocess mode values live in files, not in a registry; a scrape
        # reads them all through a fresh registry (``exposition``).
        self.registry = None if self.multiprocess else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.counters = {
            key: Counter(f"batchyard_{key}", doc, labels.split(), registry=r)
            for key, (labels, doc) in _COUNTERS.items()
        }
        self.http_duration = Histogram(
            "batchyard_http_request_duration_seconds",
            "How long an HTTP answer took, by route template and method.",
            ["route", "method"],
            registry=r,
        )
        self.process_requests = Gauge(
            "batchyard_process_http_requests",
            "HTTP answers this live process gave (one series per process under --workers).",
            registry=r,
            multiprocess_mode="liveall",
        )

    # --- core.telemetry.Recorder ---------------------------------------------------------

    def http_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.counters["http_requests"].labels(route, method, str(status)).inc()
        self.http_duration.labels(route, method).observe(max(0.0, seconds))
        self.process_requests.inc()

    def model_call(self, route: str, outcome: str) -> None:
        self.counters["model_calls"].labels(route, outcome).inc()

    def tokens(self, route: str, input_tokens: int, output_tokens: int) -> None:
        self.counters["tokens"].labels(route, "input").inc(input_tokens)
        self.counters["tokens"].labels(route, "output").inc(output_tokens)

    def prompt_tokens_cached(self, route: str, tokens: int) -> None:
        self.counters["prompt_tokens_cached"].labels(route).inc(tokens)

    def charged(self, purpose: str, credits: Decimal, over_hold: Decimal = Decimal(0)) -> None:
        self.counters["credits_charged"].labels(purpose).inc(float(credits))
        if over_hold:
            self.counters["charges_over_hold"].labels(purpose).inc()

    def admission(self, scope: str, verdict: str, limit: str | None) -> None:
        self.counters["limiter_admissions"].labels(scope, verdict, limit or "").inc()

    def upstream_429(self, route: str, retry_after_s: float) -> None:
        self.counters["upstream_429"].labels(route).inc()
        self.counters["upstream_retry_after_seconds"].labels(route).inc(max(0.0, retry_after_s))

    def leases_recovered(self, kind: str, count: int) -> None:
        if count:
            self.counters["leases_recovered"].labels(kind).inc(count)

    def uncertain(self, kind: str, count: int) -> None:
        if count:
            self.counters["items_uncertain"].labels(kind).inc(count)

    def work_stuck(self, kind: str, reason: str) -> None:
        self.counters["work_stuck"].labels(kind, reason).inc()

    # --- /metrics ---------------------------------------------------------------------------

    def exposition(self, backlog: Backlog | None, shelves: Sequence[CacheState] = ()) -> bytes:
        """The text format of every metric, with the store's backlog (when it could be read)
        and the embedded model's shelves in this process."""
        registry = CollectorRegistry(auto_describe=True)
        if self.multiprocess:
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        registry.register(_BacklogCollector(backlog))
        registry.register(_ShelfCollector(shelves))
        # This process's own registry first, as one scrape of both would list them.
        own = generate_latest(self.registry) if self.registry is not None else b""
        return own + generate_latest(registry)


class _BacklogCollector(Collector):
    """Queue depths and holds read from the store for this scrape."""

    def __init__(self, backlog: Backlog | None) -> None:
        self._backlog = backlog

    def collect(self):  # type: ignore[no-untyped-def]
        up = GaugeMetricFamily(
            "batchyard_store_up", "1 when this scrape could read the backlog from the store."
        )
        up.add_metric([], 1.0 if self._backlog is not None else 0.0)
        yield up
        b = self._backlog
        if b is None:
            return
        depth = GaugeMetricFamily(
            "batchyard_queue_depth",
            "Work waiting in the store: run rows, deferred items, file-batch lines.",
            labels=["queue"],
        )
        depth.add_metric(["run_rows"], float(b.run_rows))
        depth.add_metric(["deferred_items"], float(b.deferred_items))
        depth.add_metric(["file_batch_lines"], float(b.file_batch_lines))
        yield depth
        holds = GaugeMetricFamily("batchyard_holds_open", "Reservations still held.")
        holds.add_metric([], float(b.holds))
        yield holds
        held = GaugeMetricFamily(
            "batchyard_holds_credits", "Credits (US dollars) held by open reservations."
        )
        held.add_metric([], float(from_ticks(b.held_ticks)))
        yield held


class _ShelfCollector(Collector):
    """The embedded model's shelf in this process, read for this scrape."""

    def __init__(self, shelves: Sequence[CacheState]) -> None:
        self._shelves = shelves

    def collect(self):  # type: ignore[no-untyped-def]
        if not self._shelves:
            return
        held = GaugeMetricFamily(
            "batchyard_embedded_shelf_bytes",
            "Host memory the embedded model's shelf holds: prompts moved out of its KV cache.",
            labels=["model"],
        )
        prompts = GaugeMetricFamily(
            "batchyard_embedded_shelf_prompts",
            "Prompts on the embedded model's shelf.",
            labels=["model"],
        )
        for state in self._shelves:
            held.add_metric([state.model], float(state.shelf_bytes))
            prompts.add_metric([state.model], float(state.shelf_prompts))
        yield held
        yield prompts
