"""The composition root: every part of a deployment is built and wired here, and only here.

``build_service`` turns settings into a ``Service``: the store, the limiter
the settings ask for, the engines, the dispatcher, the batch encryption key
and the background workers (the webhook sender among them), each handed only
the parts it uses.
``create_app`` mounts the API's routers and the workspace's pages over that
service, with ``/healthz`` (the process is up) and ``/readyz`` (it can serve:
each of ``READINESS`` passes). The CLI (``serve``, ``worker``), the tests and
the benchmarks all start from these functions, so there is one place to read to see how
batchyard fits together, and a test swaps a clock, an engine or a limiter
by passing it in here once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.config import ConfigError, Settings, load_settings
from batchyard.core.limits import InMemoryLimiter, Limit, Limiter
from batchyard.core.market import Policy, policy_by_name
from batchyard.core.prices import PriceBook
from batchyard.core.telemetry import MeteredLimiter, Recorder
from batchyard.engines.protocol import Engine
from batchyard.engines.tokenizers import Tokenizers
from batchyard.errors import StorageUnavailable
from batchyard.service import Service
from batchyard.service.access import check_complete
from batchyard.service.metrics import PrometheusRecorder
from batchyard.service.model_versions import fetcher as version_fetcher
from batchyard.service.model_versions import gate as version_gate
from batchyard.store import health, key_check, migrations
from batchyard.store.database import Database
from batchyard.work.batch_key import BatchKey, resolve_key
from batchyard.work.decide_scoring import Calibrations
from batchyard.work.deferred_batches.deferred_batch_worker import (
    DeferredBatchSettings,
    DeferredBatchWorker,
)
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.engines import EngineRegistry
from batchyard.work.file_batches.file_batch_worker import FileBatchWorker
from batchyard.work.holds import HoldSweeper
from batchyard.work.market_prices import MarketPrices
from batchyard.work.price_feed import PriceFeed
from batchyard.work.runner import Periodic
from batchyard.work.runs.run_worker import RunWorker
from batchyard.work.stuck_watch import StuckWatch
from batchyard.work.warmth import SWEEP_EVERY_S, Warmth
from batchyard.work.webhook_sender import WebhookSender

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.telemetry import TelemetryConfig

__all__ = [
    "BACKGROUND_ENV",
    "READINESS",
    "ReadinessCheck",
    "app_from_environment",
    "build_service",
    "create_app",
    "create_metrics_app",
    "deferred_batch_worker",
    "file_batch_worker",
    "limiter_from_url",
    "limiter_reachable",
    "migrations_current",
    "run_worker",
    "store_writable",
    "stuck_watch",
    "verify_batch_key",
    "verify_embedded_model",
    "verify_key_of",
]

log = logging.getLogger("batchyard.app")


def limiter_from_url(url: str | None, clock: Clock, engine: sqlalchemy.Engine) -> Limiter:
    """The limiter a deployment asked for.

    ``None`` or ``memory``: in-process (one replica). ``redis://``/``rediss://``/
    ``unix://``: shared through Redis. ``sql``: shared through the store's own
    database, for deployments that run PostgreSQL but no Redis.
    """
    if url is None or url in ("memory", "memory://"):
        return InMemoryLimiter(clock)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from batchyard.store.redis_limiter import RedisLimiter

        return RedisLimiter(url, clock)
    if url == "sql":
        from batchyard.store.sql_limiter import SqlLimiter

        return SqlLimiter(engine, clock)
    raise ValueError(f"unknown limiter url scheme: {url.split('://')[0]!r}")


def build_service(
    settings: Settings,
    *,
    clock: Clock | None = None,
    engines: dict[str, Engine] | None = None,
    limiter: Limiter | None = None,
    policy: Policy | None = None,
) -> Service:
    """Every part of one deployment, wired; nothing starts until ``Service.start``.

    ``engines`` puts engines behind route IDs (tests, embedding applications);
    other routes get theirs from the catalog on first use.
    """
    clock = clock or SystemClock()
    key = resolve_key(settings, sealed_data=lambda: _holds_sealed_data(settings))
    db = Database(settings.database_url, sealer=key.sealer)
    metrics = PrometheusRecorder()
    limiter = MeteredLimiter(
        limiter or limiter_from_url(settings.limiter_url, clock, db.engine), metrics
    )
    versions = settings.model_versions
    registry = EngineRegistry(
        embedded_model_path=settings.embedded_model_path,
        embedded_slots=settings.embedded_slots,
        embedded_n_ctx=settings.embedded_n_ctx,
        embedded_threads=settings.embedded_threads,
        embedded_prefill_tokens=settings.embedded_prefill_tokens,
        embedded_cache_tokens=settings.embedded_cache_tokens,
        embedded_shelf_mb=settings.embedded_shelf_mb,
        overrides=engines,
        clock=clock,
        version_idle_s=versions.idle_s,
        version_memory_bytes=versions.memory_budget_bytes,
    )
    try:
        registry.check(settings.catalog)  # an unknown engine fails here, not on every call
    except ConfigError as exc:
        raise exc.at(settings.config_file or "the settings") from None
    dispatcher = Dispatcher(
        db=db,
        clock=clock,
        limiter=limiter,
        engines=registry,
        tiers=settings.tiers,
        upstream_unavailable_retries=settings.upstream_unavailable_retries,
        metrics=metrics,
    )
    tokenizers = Tokenizers(settings.embedded_model_path)
    if key.created:
        log.info(
            "created a batch encryption key",
            extra={"event": "batch_key_created", "path": key.path},
        )
    deferred_batches = _deferred_batch_worker(settings, db, clock, dispatcher, key, policy=policy)
    runs = _run_worker(settings, db, clock, dispatcher, tokenizers)
    file_batches = _file_batch_worker(
        settings, db, clock, dispatcher, key, deferred_batches.prices, deferred_batches.policy
    )
    warmth = Warmth(clock=clock, engines=registry, dispatcher=dispatcher, idle_s=versions.idle_s)
    holds = HoldSweeper(db=db, clock=clock)
    stuck_watch = _stuck_watch(settings, db, clock, dispatcher, deferred_batches.prices)
    webhooks = webhook_sender_of(settings, db, clock, metrics)
    # Versions uploaded into projects (mv.…) are found in the store on first use,
    # and checked against it on each use (a delete through any process counts).
    settings.catalog.fetch_with(version_fetcher(db, settings.catalog, settings.version_folder))
    registry.gate_with(version_gate(db, settings.catalog))
    return Service(
        settings=settings,
        clock=clock,
        db=db,
        limiter=limiter,
        engines=registry,
        dispatcher=dispatcher,
        calibrations=Calibrations(dispatcher),
        tokenizers=tokenizers,
        batch_key=key,
        deferred_batches=deferred_batches,
        runs=runs,
        warmth=warmth,
        file_batches=file_batches,
        holds=holds,
        webhooks=webhooks,
        metrics=metrics,
        workers=[
            deferred_batches,
            runs,  # batch inference runs
            file_batches,  # OpenAI file batches (and Anthropic's Message Batches on them)
            webhooks,  # the webhook outbox: batches' ends told to their owners' endpoints
            Periodic("warmth", clock, SWEEP_EVERY_S, warmth.sweep, close=warmth.aclose),
            Periodic("holds", clock, holds.interval_s, holds.sweep),
            Periodic("stuck", clock, stuck_watch.interval_s, stuck_watch.sweep),
        ],
    )


def _holds_sealed_data(settings: Settings) -> bool:
    """Whether an SQLite file already holds sealed data (asked before making a new key)."""
    path = settings.sqlite_path
    if path is None or not path.is_file():
        return False
    engine = sqlalchemy.create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            return key_check.sealed_data(conn)
    except sqlalchemy.exc.DBAPIError:
        return False  # a file that cannot be read is refused by the migration, in one line
    finally:
        engine.dispose()


def verify_embedded_model(service: Service) -> None:
    """Refuse to serve an embedded route whose model file is not installed.

    ``serve`` and ``worker`` call it before any work: without the file they
    used to start and answer every call on the route 503 ``model_file_missing``,
    so a fresh ``pip install batchyard[server]`` looked broken at its first
    request instead of saying, at start, which package to add. Raises
    ``ConfigError``.
    """
    from batchyard.engines.model_files import default_model_path
    from batchyard.errors import ServiceUnavailable

    embedded = sorted(
        r.id for r in service.settings.catalog.routes.values() if r.engine == "llama_cpp"
    )
    if not embedded or service.settings.embedded_model_path:
        return  # no embedded route, or a path the settings already checked
    try:
        default_model_path()
    except ServiceUnavailable as exc:
        raise ConfigError(
            f"routes[{embedded[0]}]",
            f"the embedded model is not installed: {exc.message}",
            "or give the embedded routes another engine in the config file",
        ) from None


def verify_batch_key(service: Service) -> None:
    """Refuse a key (or no key) that cannot open the data this database already seals.

    ``serve`` and ``worker`` call it after migrating, before any work: a wrong
    key used to start and answer 500 on every read of sealed data. The first
    process with a key on a database records the key's fingerprint. Raises
    ``ConfigError`` naming where the key came from.
    """
    _verify_key(service.settings, service.db, service.batch_key, service.clock.now())


def verify_key_of(settings: Settings, db: Database, clock: Clock) -> None:
    """``verify_batch_key`` for a command that has no service (``audit``); makes no key.

    The audit reads only the ledger, which is not sealed, so on a database whose key
    is configured elsewhere (PostgreSQL, no key here) it runs; a key given that is
    not the store's, or an SQLite ``batch.key`` gone missing, is still refused.
    """
    key = resolve_key(settings, create=False)
    if key.sealer is None and key.path is None:
        return
    _verify_key(settings, db, key, clock.now())


def _verify_key(settings: Settings, db: Database, key: BatchKey, now: datetime) -> None:
    try:
        try:
            verdict = db.transact_sync(lambda c: key_check.verify(c, key.sealer, now, write=True))
        except sqlalchemy.exc.IntegrityError:
            # Another process starting at the same moment recorded its key first: compare.
            verdict = db.transact_sync(lambda c: key_check.verify(c, key.sealer, now, write=True))
    except StorageUnavailable:
        # A store that takes no writes (audit on a read-only copy) can still be checked.
        verdict = db.read_sync(lambda c: key_check.verify(c, key.sealer, now, write=False))
    if verdict.problem is None:
        if verdict.adopted:
            log.info(
                "recorded the batch key's fingerprint",
                extra={"event": "batch_key_recorded", "fingerprint": key.fingerprint},
            )
        return
    if key.path is not None:
        source, field = key.path, ""
    elif key.sealer is not None and os.environ.get("BATCHYARD_BATCH_ENCRYPTION_KEY"):
        source, field = "environment variable BATCHYARD_BATCH_ENCRYPTION_KEY", ""
    else:
        source = settings.config_file or "the settings"
        field = "batch_encryption_key"
    raise ConfigError(
        field,
        verdict.problem,
        "give the key that sealed it (restore batch.key or the key from your backup); "
        "batchyard never makes a new key over sealed data",
        source=source,
    )


def deferred_batch_worker(
    service: Service,
    *,
    policy: Policy | None = None,
    book: PriceBook | None = None,
    **knobs: Any,
) -> DeferredBatchWorker:
    """Another deferred-batch worker over ``service``'s parts (a second process, in tests).

    Workers in one process may share a ``book``; each polls its own feed.
    ``knobs`` override ``DeferredBatchSettings`` (``per_pass``, ``lease_s``, ...).
    """
    return _deferred_batch_worker(
        service.settings,
        service.db,
        service.clock,
        service.dispatcher,
        service.batch_key,
        policy=policy,
        book=book,
        **knobs,
    )


def run_worker(service: Service, *, owner: str | None = None) -> RunWorker:
    """Another batch-inference-run worker over ``service``'s parts (a second process, in tests)."""
    return _run_worker(
        service.settings,
        service.db,
        service.clock,
        service.dispatcher,
        service.tokenizers,
        owner=owner,
    )


def stuck_watch(service: Service) -> StuckWatch:
    """The stuck-work watch over ``service``'s parts, as its worker processes run it."""
    return _stuck_watch(
        service.settings,
        service.db,
        service.clock,
        service.dispatcher,
        service.deferred_batches.prices,
    )


def _stuck_watch(
    s: Settings, db: Database, clock: Clock, dispatcher: Dispatcher, prices: MarketPrices
) -> StuckWatch:
    return StuckWatch(
        db=db,
        clock=clock,
        catalog=s.catalog,
        health=dispatcher.health,
        prices=prices,
        metrics=dispatcher.metrics,
        stuck_after_s=s.stuck_after_s,
    )


def file_batch_worker(service: Service, *, owner: str | None = None) -> FileBatchWorker:
    """Another file-batch worker over ``service``'s parts (a second process, in tests)."""
    return _file_batch_worker(
        service.settings,
        service.db,
        service.clock,
        service.dispatcher,
        service.batch_key,
        service.deferred_batches.prices,
        service.deferred_batches.policy,
        owner=owner,
    )


def _file_batch_worker(
    s: Settings,
    db: Database,
    clock: Clock,
    dispatcher: Dispatcher,
    key: BatchKey,
    prices: MarketPrices,
    policy: Policy,
    *,
    owner: str | None = None,
) -> FileBatchWorker:
    """File batches share the market's prices and policy: a batch that waits for a discount
    or a price reads them."""
    return FileBatchWorker(
        db=db,
        clock=clock,
        catalog=s.catalog,
        dispatcher=dispatcher,
        key=key,
        prices=prices,
        policy=policy,
        settings=s.file_batches,
        owner=owner,
    )


def webhook_sender_of(
    s: Settings, db: Database, clock: Clock, metrics: Recorder, *, owner: str | None = None
) -> WebhookSender:
    """The webhook outbox's sender, with the ``webhooks:`` settings (another one in tests)."""
    return WebhookSender(
        db=db,
        clock=clock,
        metrics=metrics,
        settings=s.webhooks,
        owner=owner,
    )


def webhook_sender(service: Service, *, owner: str | None = None) -> WebhookSender:
    """Another webhook sender over ``service``'s parts (a second process, in tests)."""
    return webhook_sender_of(
        service.settings, service.db, service.clock, service.metrics, owner=owner
    )


def _deferred_batch_worker(
    s: Settings,
    db: Database,
    clock: Clock,
    dispatcher: Dispatcher,
    key: BatchKey,
    *,
    policy: Policy | None = None,
    book: PriceBook | None = None,
    **knobs: Any,
) -> DeferredBatchWorker:
    book = book if book is not None else PriceBook()
    settings = DeferredBatchSettings(
        interval_s=s.market_interval_s,
        feed_interval_s=s.price_feed_interval_s,
        lease_s=s.market_lease_s,
    )
    return DeferredBatchWorker(
        db=db,
        clock=clock,
        catalog=s.catalog,
        dispatcher=dispatcher,
        tiers=s.tiers,
        key=key,
        prices=MarketPrices(s.catalog, book, timedelta(seconds=s.price_max_age_s)),
        policy=policy or policy_by_name(s.market_policy),
        feed=PriceFeed(s.price_feed, book, clock) if s.price_feed else None,
        settings=dataclasses.replace(settings, **knobs),
    )


def _run_worker(
    s: Settings,
    db: Database,
    clock: Clock,
    dispatcher: Dispatcher,
    tokenizers: Tokenizers,
    *,
    owner: str | None = None,
) -> RunWorker:
    return RunWorker(
        db=db,
        clock=clock,
        catalog=s.catalog,
        dispatcher=dispatcher,
        tokenizers=tokenizers,
        tiers=s.tiers,
        settings=s.runs,
        billing_review_threshold=s.billing_review_threshold,
        owner=owner,
    )


#: One readiness check: why the deployment cannot serve right now, or None when it can.
ReadinessCheck = Callable[[Service], Awaitable[str | None]]

#: How long ``/readyz`` waits for the store to take its probe write.
#: FastAPI's own OpenTelemetry, off: batchyard counts in ``/metrics`` instead, and with it
#: on FastAPI asks the global providers whether they are configured on every request.
NO_OTEL: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}

PROBE_TIMEOUT_S = 5.0


async def store_writable(service: Service) -> str | None:
    """The store takes a write (a full disk or a read-only file fails here, reads do not)."""
    now = service.clock.now()
    try:
        await asyncio.wait_for(
            service.db.transact(lambda c: health.probe(c, "readyz", now)), PROBE_TIMEOUT_S
        )
    except StorageUnavailable as exc:
        return exc.message
    except TimeoutError:
        return f"the store did not take a write within {PROBE_TIMEOUT_S:g} s"
    return None


async def migrations_current(service: Service) -> str | None:
    """The database's schema is this code's Alembic head (not older, not newer)."""
    try:
        return await asyncio.wait_for(service.db.read(migrations.behind), PROBE_TIMEOUT_S)
    except StorageUnavailable as exc:
        return exc.message
    except TimeoutError:
        return f"the store did not answer within {PROBE_TIMEOUT_S:g} s"


#: The limiter key ``/readyz`` looks at; a look costs nothing, so it spends nothing.
_PROBE_LIMIT = ((Limit("readyz", 60.0), 0.0),)


async def limiter_reachable(service: Service) -> str | None:
    """The limiter answers (Redis, or the database's limiter table): a look that spends nothing."""
    try:
        await asyncio.wait_for(
            service.limiter.try_acquire("health:readyz", _PROBE_LIMIT), PROBE_TIMEOUT_S
        )
    except TimeoutError:
        return f"the limiter did not answer within {PROBE_TIMEOUT_S:g} s"
    except Exception as exc:  # any backend's failure is the answer, not a crash
        return f"the limiter cannot be reached: {type(exc).__name__}: {exc}"
    return None


#: What ``/readyz`` checks, by name; a deployment (or another part) adds its own.
READINESS: tuple[tuple[str, ReadinessCheck], ...] = (
    ("store", store_writable),
    ("migrations", migrations_current),
    ("limiter", limiter_reachable),
)


def create_app(
    service: Service,
    *,
    worker: bool = True,
    close_on_exit: bool = True,
    readiness: Sequence[tuple[str, ReadinessCheck]] = READINESS,
) -> FastAPI:
    """The HTTP app; ``close_on_exit=False`` leaves closing the service to its owner (tests).

    The doors are imported here, not at the top: a ``batchyard worker`` process
    builds the service and never serves HTTP, so it starts without them.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from batchyard.api import (
        account,
        batches,
        decide,
        files,
        messages,
        metering,
        models,
        openai_door,
        projects,
        runs,
        webhooks,
    )
    from batchyard.api.envelope import EnvelopeMiddleware, install_error_handlers
    from batchyard.api.openapi import Health, Readiness, declare, install_openapi
    from batchyard.api.overflow import OverflowMiddleware
    from batchyard.web import file_pages
    from batchyard.web import routes as workspace

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start(worker=worker)
        try:
            yield
        finally:
            if close_on_exit:
                # The server stopped taking requests: drain the workers, then close.
                await service.stop(grace_s=service.settings.shutdown_grace_s)
            else:
                await service.stop_workers()

    # FastAPI's own docs pages load their scripts from a CDN; ours load nothing.
    app = FastAPI(
        title="batchyard",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        telemetry=NO_OTEL,
    )
    app.state.service = service
    install_error_handlers(app)
    app.add_middleware(OverflowMiddleware)
    app.add_middleware(EnvelopeMiddleware)
    app.add_middleware(metering.MeteringMiddleware, recorder=service.metrics, clock=service.clock)

    @app.get("/healthz", response_model=None, summary="Liveness: the process is up")
    @declare(Health, errors=(503,), public=True)
    async def healthz() -> JSONResponse:
        ok = service.started
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    @app.get(
        "/readyz",
        response_model=None,
        summary="Readiness: store writable, migrations current, limiter reachable",
    )
    @declare(Readiness, errors=(503,), public=True)
    async def readyz() -> JSONResponse:
        """200 when every check passes; 503 with each failing check's reason otherwise."""
        if not service.started or service.draining:
            status = "draining" if service.draining else "starting"
            return JSONResponse({"status": status, "checks": {}}, status_code=503)
        checks: dict[str, dict[str, Any]] = {}
        for name, check in readiness:
            reason = await check(service)
            checks[name] = {"ok": True} if reason is None else {"ok": False, "reason": reason}
        ready = all(c["ok"] for c in checks.values())
        return JSONResponse(
            {"status": "ready" if ready else "unready", "checks": checks},
            status_code=200 if ready else 503,
        )

    # One router per front door; each door adds its own line.
    app.include_router(account.router)  # ... and the caps on a key's and a project's spend
    app.include_router(batches.router)
    app.include_router(openai_door.router)  # chat, completions, embeddings
    app.include_router(decide.router)
    app.include_router(files.router)
    app.include_router(messages.router)  # Anthropic's door: Messages and Message Batches
    app.include_router(models.router)  # ... and a project's uploaded model versions
    app.include_router(projects.router)
    app.include_router(runs.router)
    app.include_router(metering.router)  # /metrics
    app.include_router(webhooks.router)  # /v1/webhook-endpoints
    app.include_router(workspace.router)  # the Batches workspace pages (web/)
    app.include_router(file_pages.router)  # ... and its file batches
    install_openapi(app)
    check_complete(app)  # every route has its row in the scope matrix (service.access)
    return app


def create_metrics_app(service: Service) -> FastAPI:
    """A ``batchyard worker``'s own small HTTP app: ``/healthz`` and ``/metrics``.

    A worker serves no API, yet it makes the model calls, charges, recovers leases and
    marks items uncertain; without a port of its own, those counts would live and die in
    its memory, unscraped. It is the same ``/metrics`` (and the same token) as the API's.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from batchyard.api import metering
    from batchyard.api.envelope import install_error_handlers

    app = FastAPI(
        title="batchyard worker",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        telemetry=NO_OTEL,
    )
    app.state.service = service
    install_error_handlers(app)

    @app.get("/healthz", response_model=None)
    async def healthz() -> JSONResponse:
        ok = service.started and not service.draining
        return JSONResponse({"status": "ok" if ok else "stopping"}, status_code=200 if ok else 503)

    app.include_router(metering.router)
    return app


#: Set to ``1`` by ``serve --workers N --with-worker``: each API process runs background work too.
BACKGROUND_ENV = "BATCHYARD_SERVE_BACKGROUND"


def app_from_environment() -> FastAPI:
    """One API process of ``batchyard serve --workers N`` (uvicorn calls this factory in each).

    Settings come from the environment the parent set (``BATCHYARD_CONFIG``,
    ``BATCHYARD_DATABASE_URL``, ``BATCHYARD_SHUTDOWN_GRACE_S``), as
    ``load_settings`` reads them; the parent migrated the store already.
    """
    from batchyard.logs import setup_logging

    setup_logging(os.environ.get("BATCHYARD_LOG_LEVEL", "INFO").upper())
    service = build_service(load_settings())
    return create_app(service, worker=os.environ.get(BACKGROUND_ENV) == "1")
