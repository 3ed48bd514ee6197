"""One database handle for both backends, and the way into a transaction.

SQLite runs with WAL, ``synchronous=FULL`` (money is at stake) and a busy
timeout, and every writing transaction starts with ``BEGIN IMMEDIATE``: a
deferred transaction that reads and then writes fails with SQLITE_BUSY instead
of waiting its turn. PostgreSQL runs the same code; row locks come from the
queries themselves (``FOR UPDATE``).

Blocking database work runs on a small thread pool so the event loop keeps
serving while a transaction commits.

A store that cannot write (a full disk, a read-only file, PostgreSQL down or
out of space) surfaces as ``StorageUnavailable``: 503 with ``retryable: true``
at the door, never a 500. Every write is one transaction, so a failed one left
nothing behind and the same request can be sent again. A new SQLite file is
created with mode 0600 (SQLite gives its ``-wal`` and ``-shm`` files the
database file's mode): the store holds money and, sealed, customers' text.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import DatabaseError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import InternalError as SqlInternalError
from sqlalchemy.pool import StaticPool

from batchyard.core.clock import Clock, SystemClock
from batchyard.core.sealing import Sealer
from batchyard.errors import StorageUnavailable

__all__ = ["Database", "storage_failure"]

log = logging.getLogger("batchyard.store")
T = TypeVar("T")

# PostgreSQL states that mean "the store cannot take writes now", not "this
# statement is wrong": read-only transactions (25006) and insufficient
# resources such as a full disk (class 53).
_STORAGE_STATES = ("25006", "53")

# How long PostgreSQL lets a session sit inside a transaction with nothing to do
# before it ends the session. Our transactions run start to finish on one thread,
# so only a frozen process (SIGSTOP, a paused VM, a long GC) leaves one idle: its
# row locks would otherwise hold until it woke, and claims skip locked rows, so
# no other worker could take over its leased work. The default run lease.
IDLE_TRANSACTION_S = 60.0


def storage_failure(exc: BaseException) -> StorageUnavailable | None:
    """The 503 a driver error stands for, or None when it is not the store's condition."""
    if not isinstance(exc, DBAPIError):
        return None
    state = str(getattr(exc.orig, "sqlstate", "") or "")
    if not (
        isinstance(exc, OperationalError | InterfaceError)
        or exc.connection_invalidated
        or (isinstance(exc, SqlInternalError) and state.startswith(_STORAGE_STATES))
        # SQLite's own "file is not a database", "database disk image is malformed".
        or type(exc) is DatabaseError
    ):
        return None
    reason = str(exc.orig).strip().splitlines()[0][:200] if exc.orig is not None else "unknown"
    failure = StorageUnavailable(
        f"the store cannot be used right now ({reason}); nothing was written: "
        "send the same request again (same Idempotency-Key) shortly",
        retry_after=5,
    )
    failure.__cause__ = exc
    return failure


def _create_private(path: Path) -> None:
    """Create the SQLite file 0600 before SQLite does (it would use 0644 & ~umask)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning(
                "the database file is readable by others",
                extra={"event": "database_file_mode", "mode": oct(mode)},
            )
        return
    os.close(fd)


class Database:
    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 8,
        sealer: Sealer | None = None,
        clock: Clock | None = None,
        idle_transaction_s: float = IDLE_TRANSACTION_S,
    ) -> None:
        self.url = url
        self.sealer = sealer
        # How long a write that must land waits out an outage (``write_through``). A
        # store outage is one of real time, so this is the real clock unless a test
        # hands in its own.
        self.clock: Clock = clock or SystemClock()
        self.is_sqlite = url.startswith("sqlite")
        self._lock: threading.Lock | None = None
        self._writer: threading.RLock | None = None
        if self.is_sqlite:
            memory = url in ("sqlite://", "sqlite:///:memory:")
            if not memory:
                _create_private(Path(url.split("///", 1)[1]))
            kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False, "timeout": 30}}
            if memory:
                # One shared connection; a lock keeps threads from interleaving on it.
                kwargs["poolclass"] = StaticPool
                self._lock = threading.Lock()
            else:
                kwargs["pool_size"] = pool_size
                # SQLite has one writer. Our threads queue for it on a lock that
                # wakes the next one at once, instead of in SQLite's busy handler,
                # which sleeps in steps of up to 100 ms (other processes still
                # wait there). Measured in bench/dispatch.py.
                self._writer = threading.RLock()
            # Parameters carry saved responses and key hashes: never into a log,
            # even when an operator turns SQLAlchemy's own logging on.
            self.engine: Engine = create_engine(url, hide_parameters=True, **kwargs)
            self._install_sqlite_hooks(memory)
        else:
            self.engine = create_engine(
                url,
                pool_size=pool_size,
                max_overflow=pool_size,
                pool_pre_ping=True,
                hide_parameters=True,
                connect_args={
                    "options": "-c idle_in_transaction_session_timeout="
                    f"{max(1, round(idle_transaction_s * 1000))}"
                },
            )

        # Customer text is sealed by the queries themselves (``store.at_rest``),
        # with the sealer every connection carries.
        @event.listens_for(self.engine, "connect")
        def _carry_sealer(_dbapi_conn: Any, record: Any) -> None:
            record.info["sealer"] = sealer

        self._queue: list[tuple[Callable[[Connection], Any], asyncio.Future[Any], Any]] = []
        self._queue_lock = threading.Lock()
        self._later: set[asyncio.Task[None]] = set()
        self._writer_busy = False
        self.group_limit = 64
        self._executor = ThreadPoolExecutor(
            max_workers=pool_size, thread_name_prefix="batchyard-db"
        )

    def _install_sqlite_hooks(self, memory: bool) -> None:
        @event.listens_for(self.engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            # Let us issue BEGIN ourselves instead of pysqlite's implicit one.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            if not memory:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(self.engine, "begin")
        def _on_begin(conn: Connection) -> None:
            mode = conn.get_execution_options().get("sqlite_begin", "IMMEDIATE")
            _driver_sql(conn, f"BEGIN {mode}")

    @contextmanager
    def transaction(self, *, readonly: bool = False) -> Iterator[Connection]:
        """A transaction that commits on success and rolls back on any error.

        A driver error that means the store cannot be used (see ``storage_failure``)
        leaves as ``StorageUnavailable``.
        """
        try:
            with self._transaction(readonly) as conn:
                yield conn
        except DBAPIError as exc:
            failure = storage_failure(exc)
            if failure is None:
                raise
            raise failure from exc

    @contextmanager
    def _transaction(self, readonly: bool) -> Iterator[Connection]:
        if self._lock is not None:
            with self._lock, self._begin(readonly) as conn:
                yield conn
        elif self._writer is not None and not readonly:
            with self._writer, self._begin(readonly) as conn:
                yield conn
        else:
            with self._begin(readonly) as conn:
                yield conn

    @contextmanager
    def _begin(self, readonly: bool) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            if self.is_sqlite and readonly:
                conn = conn.execution_options(sqlite_begin="DEFERRED")
            with conn.begin():
                yield conn

    def read_sync(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a read-only transaction on this thread."""
        with self.transaction(readonly=True) as conn:
            return fn(conn)

    def transact_sync(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a writing transaction of its own on this thread."""
        with self.transaction() as conn:
            return fn(conn)

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a read-only transaction on the database threads.

        On SQLite a reader never waits for the writer (WAL); on PostgreSQL
        reads run in parallel on the pool.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self.read_sync(fn))

    async def transact(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` in a writing transaction of its own on the database threads.

        For writes that are long (a batch of rows), lock many rows (claims),
        or must not share a commit with anyone else's. Short writes on a hot
        path use ``write``, which shares one commit among concurrent callers.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self.transact_sync(fn))

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn(conn)`` atomically, committed together with other writes: the hot path.

        Group commit: concurrent writes queue for one writer thread, which runs
        each in a savepoint of a shared transaction and commits them with one
        fsync. Each write is still all-or-nothing (its savepoint rolls back on
        error and only its caller sees the error), and no caller hears of
        success before the commit is durable. Under load this turns two fsyncs
        per model call into two per batch of calls, which is what lets SQLite
        with ``synchronous=FULL`` keep up with the dispatcher.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._queue_lock:
            self._queue.append((fn, fut, loop))
            if not self._writer_busy:
                self._writer_busy = True
                self._executor.submit(self._drain)
        return await fut

    async def write_through(self, fn: Callable[[Connection], T], *, patience_s: float = 30.0) -> T:
        """``write`` for what must not be lost: retried while the store is unavailable.

        A settlement after a model call, or the answer saved under its
        Idempotency-Key, records something that already happened; giving up
        at the first full-disk error would strand a hold (and leave the key
        in progress). Each attempt is still one atomic write; after
        ``patience_s`` seconds of ``StorageUnavailable`` the last one is raised.
        """
        return await self._through(self.write, fn, patience_s)

    async def transact_through(
        self, fn: Callable[[Connection], T], *, patience_s: float = 30.0
    ) -> T:
        """``transact``, retried like ``write_through`` while the store is unavailable."""
        return await self._through(self.transact, fn, patience_s)

    async def _through(
        self,
        run: Callable[[Callable[[Connection], T]], Awaitable[T]],
        fn: Callable[[Connection], T],
        patience_s: float,
    ) -> T:
        clock = self.clock
        deadline = clock.time() + patience_s
        pause = 0.05
        while True:
            try:
                return await run(fn)
            except StorageUnavailable:
                if clock.time() + pause > deadline:
                    raise
                log.warning("store unavailable; retrying a write", extra={"event": "write_retry"})
                await clock.sleep(pause)
                pause = min(pause * 2, 2.0)

    def write_later(self, fn: Callable[[Connection], Any], *, patience_s: float = 600.0) -> None:
        """``write_through`` in the background: for a write the caller must not wait for."""

        async def attempt() -> None:
            try:
                await self.write_through(fn, patience_s=patience_s)
            except StorageUnavailable:
                log.error("a deferred write was given up", extra={"event": "write_given_up"})

        task = asyncio.get_running_loop().create_task(attempt())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    def _drain(self) -> None:
        while True:
            with self._queue_lock:
                batch = self._queue[: self.group_limit]
                del self._queue[: len(batch)]
                if not batch:
                    self._writer_busy = False
                    return
            results: list[tuple[bool, Any]] = []
            try:
                with self.transaction() as conn:
                    results.extend(_isolated(conn, fn) for fn, _, _ in batch)
            except BaseException as exc:  # the commit failed: nothing is durable
                results = [(False, exc)] * len(batch)
            for (_, fut, loop), (ok, value) in zip(batch, results, strict=True):
                loop.call_soon_threadsafe(_resolve, fut, ok, value)

    def migrate(self) -> None:
        """Bring the schema to head; ``StorageUnavailable`` if the store cannot be written."""
        from batchyard.store.migrations import upgrade

        try:
            upgrade(self.engine)
        except DBAPIError as exc:
            failure = storage_failure(exc)
            if failure is None:
                raise
            raise failure from exc

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def close(self) -> None:
        for task in self._later:
            task.cancel()
        self._executor.shutdown(wait=True)
        self.engine.dispose()


# One write's savepoint in a group commit, and SQLite's BEGIN, in the driver's own SQL (the
# same on SQLite and PostgreSQL), sent by ``_driver_sql``: a model call makes two writes,
# each a savepoint and its release, and most transactions are a BEGIN and one statement.
_SAVEPOINT = "SAVEPOINT batchyard_write"
_ROLLBACK_TO = "ROLLBACK TO SAVEPOINT batchyard_write"
_RELEASE = "RELEASE SAVEPOINT batchyard_write"


def _driver_sql(conn: Connection, sql: str) -> None:
    """``sql`` (no parameters, no rows) on the connection's driver cursor.

    Not through ``exec_driver_sql``: SQLAlchemy's execution path (its events, its
    result set-up) cost several times the statement, and these are statements
    SQLAlchemy has nothing to do with (``begin_nested``'s bookkeeping cost more still).
    A driver error leaves as SQLAlchemy's, as it would have through
    ``exec_driver_sql``, so ``storage_failure`` reads it alike.
    """
    dbapi = conn.dialect.loaded_dbapi
    cursor = conn.connection.cursor()
    try:
        cursor.execute(sql)
    except dbapi.Error as exc:
        raise DBAPIError.instance(sql, None, exc, dbapi.Error, dialect=conn.dialect) from exc
    finally:
        cursor.close()


def _isolated(conn: Connection, fn: Callable[[Connection], Any]) -> tuple[bool, Any]:
    """``fn(conn)`` all or nothing inside the group's transaction: (True, its value), or
    (False, its error) with what it wrote rolled back, for its own caller alone."""
    _driver_sql(conn, _SAVEPOINT)
    try:
        value = fn(conn)
    except BaseException as exc:
        _driver_sql(conn, _ROLLBACK_TO)
        _driver_sql(conn, _RELEASE)
        return False, storage_failure(exc) or exc
    _driver_sql(conn, _RELEASE)
    return True, value


def _resolve(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
