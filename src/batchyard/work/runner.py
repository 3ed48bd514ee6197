"""The leased-work runner: one loop, one claim pipeline, one way to answer a unit, one recovery.

Every kind of background work in batchyard is leased work: batch inference
runs (their rows), OpenAI file batches (their lines; Message Batches ride on
them) and deferred batches (their items). A worker claims units under leases
in the store, calls the engine for each through the dispatcher, records each
result under its lease, and whatever a dead worker held is recovered once its
lease lapses. The kinds differ in their rules (what a unit is, what its call
and its result are, what ends a batch), not in that machinery, so the
machinery is written once, here, in the shape of procrastinate's one
``Worker`` over one ``JobManager``:

- ``Runner``: the one loop every worker runs (``Worker``: notify,
  ``run_forever``, ``drain``, ``wait_idle``, ``stop``, ``tick``). A kind
  supplies its ``round`` (what one pass of its loop starts); the service holds
  its workers as a list.
- ``Pipeline``: the claim → send → record pipeline over one ``LeaseQueue``.
  It keeps the engine's slots full (``width`` calls in flight), records
  finished units, renews the leases and claims more in one transaction (so a
  fast upstream costs one commit per handful of units), marks each unit sent
  durably just before its engine call, and on a drain hands back what it
  holds.
- ``answer``: one unit's call, with the one ``NotSent`` and the one mapping
  from a failure to its error (``failure``).
- ``recover_lapsed``: the one recovery of a stopped worker's claims, counted
  one way (``batchyard_leases_recovered``, ``batchyard_uncertain``).

A kind of leased work gives the pipeline a ``LeaseQueue``: a small object
whose methods run inside the runner's transactions (claim, renew, record,
mark sent, requeue unsent, let go). An in-memory one is all the runner's own
tests need (``tests/unit/work/test_runner.py``).

Only a call that started is uncertain: a unit is marked sent, durably, just
before its engine call (``on_send``, after the route's pace and concurrency
slot). A unit claimed but never sent (the worker is draining, the store
refused the mark, the unit is no longer ours) waits again; a sent one whose
worker stopped mid-call becomes ``uncertain`` and is never sent twice.

A new kind of leased work (a webhook delivery outbox, say) needs four things:

1. Its table keeps the lease as every leased table does: ``lease_owner``,
   ``lease_expires_at``, ``lease_token`` (and ``sent_at`` for the sent mark),
   written only through ``store.leases`` (``claim``, ``renew``,
   ``held_by_each``, ``mark_sent``, ``LET_GO``).
2. A ``LeaseQueue`` over it (connection-level; see the protocol below and
   ``store``'s per-table helpers): ``claim`` the due units under leases,
   ``renew`` the held leases (``Renewal.GOING``, or ``STOPPING`` when the
   kind should claim no more), ``record`` results fenced by each lease,
   ``mark_sent``, ``requeue`` claimed units whose call never left (their
   sent mark, if any, taken back), ``let_go`` (sent:
   whatever the kind says an interrupted unit becomes; unsent: waiting), and
   a cheap ``lapsed`` read.
3. A ``call(unit, on_send)`` that awaits ``on_send()`` right before the
   outside effect (the HTTP POST) and returns what came back, raising a coded
   ``BatchyardError`` for a failure; and a ``render(unit, attempt)`` that turns
   ``Answered`` or ``Failed`` into the result ``record`` writes.
4. A ``Runner`` subclass whose ``round`` recovers (``recover_lapsed``) and
   starts ``self.new_pipeline(...).run(queue, width=..., call=..., render=...)``
   with ``self.start(key, ...)`` while there is work; ``app.build_service``
   adds it to the service's ``workers``. Drain, stop, recovery metrics and the
   wake (``notify``) then come with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from sqlalchemy import Connection

from batchyard.core.clock import Clock
from batchyard.core.ids import new_id
from batchyard.core.leases import Lease
from batchyard.core.telemetry import Recorder
from batchyard.errors import (
    BatchyardError,
    LimiterUnavailable,
    StorageUnavailable,
    UpstreamError,
    UpstreamUnreachable,
)
from batchyard.store.database import Database
from batchyard.work.dispatcher import OnSend
from batchyard.work.sending import SentMarks

__all__ = [
    "Answered",
    "Claim",
    "Failed",
    "LeaseQueue",
    "NotSent",
    "Periodic",
    "Pipeline",
    "Ran",
    "Recovered",
    "Renewal",
    "Runner",
    "Unsent",
    "Worker",
    "answer",
    "count_recovered",
    "failure",
    "recover_lapsed",
    "uncertain_detail",
]

log = logging.getLogger("batchyard.runner")

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
U = TypeVar("U")
R = TypeVar("R")
R_contra = TypeVar("R_contra", contravariant=True)


# --- the loop ---------------------------------------------------------------------------


@runtime_checkable
class Worker(Protocol):
    """One background loop of a deployment, as the service starts, drains and stops it."""

    name: str

    def notify(self) -> None:
        """Wake the loop now (new work arrived); a no-op while it is not running."""
        ...

    async def run_forever(self) -> None:
        """Round after round until cancelled."""
        ...

    def drain(self) -> None:
        """Claim and send nothing more; calls in flight go on (see ``wait_idle``)."""
        ...

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait up to ``grace_s`` seconds for the work in hand; True when none is left."""
        ...

    async def stop(self) -> None:
        """Abandon the work in hand: as a crash would, or, while draining, handing it back."""
        ...

    async def tick(self) -> int:
        """One round; how much work is in hand after it."""
        ...


class Runner:
    """The one loop: a round, then a pause until notified or ``poll_s`` has passed.

    A kind of work subclasses it for its ``round`` (and, where it needs them,
    ``opening`` and ``closing``); the lifecycle and the bookkeeping of the
    tasks a round starts (``start``) are this class's.

    The pause is a time rule where ``timed`` (deferred batches' "about
    every 15 seconds": on the clock, so a test moves a ``ManualClock``), and
    otherwise only a poll: the clock's seconds or the same real seconds,
    whichever come first, since leases and deadlines read the clock and a
    poll must not stand still with it.
    """

    def __init__(
        self,
        *,
        name: str,
        clock: Clock,
        poll_s: float,
        timed: bool = False,
        owner: str | None = None,
    ) -> None:
        self.name = name
        self.clock = clock
        #: This worker's name in every lease it takes (unique per process and start).
        self.owner = owner or new_id("wkr", clock.now())
        self.poll_s = poll_s
        self.timed = timed
        #: Set by ``drain``: claim nothing more, send nothing more.
        self.draining = False
        #: Set by ``stop``: work on threads (a run's quote) gives up.
        self.stopped = False
        self._active: dict[str, asyncio.Task[Any]] = {}
        self._wake: asyncio.Event | None = None
        self._again = False

    # The hooks a kind of work fills in.

    async def opening(self) -> bool:
        """Before the first round; False: this worker has nothing to do here (and returns)."""
        return True

    async def round(self) -> bool:
        """One pass of the kind's rules; True when more is ready at once (no pause)."""
        return False

    async def closing(self) -> None:
        """After the loop ended (cancelled), once the work in hand was stopped."""

    # The lifecycle.

    def notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run_forever(self) -> None:
        self.stopped = False
        if not await self.opening():
            return
        self._wake = asyncio.Event()
        try:
            while True:
                try:
                    await self.tick()
                except StorageUnavailable as exc:
                    # An outage, not a bug: no traceback; the next round reconnects.
                    log.warning(
                        "store unavailable; the worker waits for it",
                        extra={"worker": self.name, "code": exc.code},
                    )
                    self._again = False
                except Exception:
                    log.exception("worker round failed", extra={"worker": self.name})
                    self._again = False
                if not self._again:
                    await self._pause()
        finally:
            await self.stop()
            await self.closing()

    async def _pause(self) -> None:
        assert self._wake is not None
        # (asyncio.wait, not wait_for: on Python 3.11 a wait_for cancelled just as
        # its event is set can hang the cancellation forever.)
        waiter = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self.clock.sleep(self.poll_s))
        try:
            await asyncio.wait(
                {waiter, sleeper},
                timeout=None if self.timed else self.poll_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            waiter.cancel()
            sleeper.cancel()
        self._wake.clear()

    def drain(self) -> None:
        self.draining = True
        self.notify()

    async def wait_idle(self, grace_s: float) -> bool:
        tasks = [t for t in self._active.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        return all(t.done() for t in self._active.values())

    async def stop(self) -> None:
        self.stopped = True
        tasks = list(self._active.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._active.clear()

    async def tick(self) -> int:
        self._reap()
        self._again = await self.round()
        return len(self._active)

    async def run_until_idle(self, *, rounds: int = 10_000) -> None:
        """Work until nothing is left to start or finish (tests, benchmarks, the CLI)."""
        for _ in range(rounds):
            # Idle only when a second round finds nothing either: what the last task
            # finished may end a batch, or make more work ready.
            if not await self.tick() and not await self.tick():
                return
            if self._active:
                await asyncio.wait(list(self._active.values()), return_when=asyncio.FIRST_COMPLETED)

    def new_pipeline(
        self,
        db: Database,
        metrics: Recorder,
        *,
        lease_s: float,
        flush_s: float,
        renew_s: float | None = None,
        outage_pause_s: float = 1.0,
        unavailable_retries: int = 0,
    ) -> Pipeline:
        """A claim pipeline of this worker: it claims and sends nothing more once it drains.

        Leases are renewed every ``renew_s``, by default a third of a lease: a
        worker that misses two renewals in a row still holds its work.
        """
        return Pipeline(
            db=db,
            clock=self.clock,
            metrics=metrics,
            lease_s=lease_s,
            renew_s=lease_s / 3 if renew_s is None else renew_s,
            flush_s=flush_s,
            draining=lambda: self.draining,
            outage_pause_s=outage_pause_s,
            unavailable_retries=unavailable_retries,
        )

    # The tasks a round starts.

    @property
    def active(self) -> Mapping[str, asyncio.Task[Any]]:
        """What this worker has in hand, by key (a run, a batch, a pass)."""
        return self._active

    def start(self, key: str, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start ``work`` as this worker's task ``key``: ``wait_idle`` and ``stop`` see it."""
        task = asyncio.create_task(work, name=f"{self.name} {key}")
        self._active[key] = task
        return task

    def _reap(self) -> None:
        for key, task in list(self._active.items()):
            if task.done():
                del self._active[key]
                if not task.cancelled() and task.exception() is not None:
                    log.error(
                        "worker task failed",
                        extra={
                            "worker": self.name,
                            "task": key,
                            "error_type": type(task.exception()).__name__,
                        },
                    )


class Periodic(Runner):
    """A sweep every ``every_s`` seconds of the clock (stranded holds, versions going cold)."""

    def __init__(
        self,
        name: str,
        clock: Clock,
        every_s: float,
        sweep: Callable[[], Awaitable[object]],
        *,
        close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(name=name, clock=clock, poll_s=every_s, timed=True)
        self._sweep = sweep
        self._close = close

    async def round(self) -> bool:
        await self._sweep()
        return False

    async def closing(self) -> None:
        if self._close is not None:
            await self._close()


# --- answering one unit -------------------------------------------------------------------


class NotSent(Exception):
    """Raised by an ``on_send`` (or a unit's call before it) that refuses the call.

    The call was not made, so the unit waits again. ``stop``: claim no more
    units of this kind now (the market moved away from the batch's discount).
    """

    def __init__(self, why: str = "the call was not made", *, stop: bool = False) -> None:
        super().__init__(why)
        self.stop = stop


@dataclass(frozen=True, slots=True)
class Answered(Generic[T]):
    """The engine answered: what the unit's call returned."""

    value: T


@dataclass(frozen=True, slots=True)
class Failed:
    """The unit failed: its error, as the wire would carry it. Never retried."""

    error: BatchyardError


@dataclass(frozen=True, slots=True)
class Unsent:
    """The call never started: the unit waits again (``stop``: and claim nothing more now)."""

    why: str
    stop: bool = False


def failure(exc: BaseException) -> BatchyardError:
    """The one mapping from a failed call to its error.

    A coded error keeps its code (an upstream's 4xx or 5xx, a timeout, a
    context window); anything else is the engine failing (``upstream_error``),
    named by its type and nothing more, since its text may hold the request.
    """
    if isinstance(exc, BatchyardError):
        return exc
    return UpstreamError(f"the engine failed ({type(exc).__name__})")


async def answer(
    call: Callable[[OnSend], Awaitable[T]],
    mark: OnSend,
    *,
    clock: Clock,
    outage_pause_s: float,
    unavailable_retries: int = 0,
) -> Answered[T] | Failed | Unsent:
    """Call one unit; never raises but for cancellation (a failure is an answer too).

    ``call(on_send)`` makes the unit's engine call, handing ``on_send`` to the
    dispatcher; ``mark`` is awaited there, right before the engine, and
    records the unit sent (or raises ``NotSent``). A unit whose call never
    started is ``Unsent``: refused by ``mark``, because the store or the
    limiter was down, or because the route's upstream refused the connection
    (marked sent or not, nothing left). After an outage the unit waits ``outage_pause_s`` of
    the clock before it is handed back: claiming it again at once would only
    spin while the outage lasts.

    The one bounded automatic retry of every kind of leased work: a call the
    upstream answered 503 before taking it (``UpstreamError.not_taken``: it
    never reached the engine) is made again, up to ``unavailable_retries``
    times, after the upstream's ``Retry-After`` (else ``outage_pause_s``),
    while the unit stays claimed; then it counts as failed. Nothing else is
    sent twice here: a call that may have reached the engine is the unit's
    answer. Each attempt is marked sent again, so a worker that stops during
    the wait leaves the unit ``uncertain``, never sent twice silently; and the
    mark is refused once the pipeline stops (its batch's window closed, the
    batch was canceled, the worker drains), so no attempt goes past the unit's
    deadline: the unit is handed back unsent and ends as its kind ends those.
    """
    sent = False
    tries = 0

    async def on_send() -> None:
        nonlocal sent
        await mark()
        sent = True

    while True:
        try:
            return Answered(await call(on_send))
        except NotSent as exc:
            return Unsent(str(exc), exc.stop)
        except UpstreamUnreachable as exc:
            # The route refused the connection: the call never left, whether or not
            # the unit was marked sent, so it waits for its route (``requeue`` takes
            # the mark back) instead of failing. Its pause keeps a route that is down
            # from being asked again at once.
            await clock.sleep(outage_pause_s)
            return Unsent(exc.code)
        except (StorageUnavailable, LimiterUnavailable) as exc:
            if sent:
                return Failed(exc)
            # The store refused the mark, or the limiter could not admit the call:
            # nothing reached the engine.
            await clock.sleep(outage_pause_s)
            return Unsent(exc.code)
        except UpstreamError as exc:
            if not exc.not_taken or tries >= unavailable_retries:
                return Failed(exc)
            tries += 1
            log.info("upstream unavailable; sending again", extra={"attempt": tries})
            await clock.sleep(exc.retry_after if exc.retry_after is not None else outage_pause_s)
        except BatchyardError as exc:
            return Failed(exc)
        except Exception as exc:
            log.warning("a unit's call failed", extra={"error_type": type(exc).__name__})
            return Failed(failure(exc))


# --- the queue of one kind of leased work --------------------------------------------------


class Renewal(enum.Enum):
    """What a renewal found: go on, stop claiming (the batch ended), or the claim is lost."""

    GOING = "going"
    STOPPING = "stopping"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Claim(Generic[K, U]):
    """One unit a claim took: its key, its lease (owner and fencing token), and the unit."""

    key: K
    lease: Lease
    unit: U


@dataclass(frozen=True, slots=True)
class Recovered:
    """What letting go of claims did: leases ended, units made uncertain, units waiting again."""

    leases: int = 0
    uncertain: int = 0
    returned: int = 0


class LeaseQueue(Protocol[K, U, R_contra]):
    """A kind of leased work as the runner sees it: all it asks of the store.

    ``K`` is a unit's key (a row ID, a line number, an item ID), ``U`` what a
    claimed unit carries for its call, ``R`` a unit's result as the kind
    records it. ``held`` is always the caller's claims: key → the lease its
    claim gave. Every method runs inside a transaction the runner opens
    (connection-level), so several of them commit as one: a pipeline's step
    is ``renew`` + ``record`` + ``requeue`` + ``claim``; a hand-over is
    ``renew`` + ``record`` + ``requeue`` + ``let_go``. Every write is fenced
    by the leases in ``held``: a claim superseded since changes nothing.
    """

    #: The kind's label in metrics and logs ("runs", "file_batches", "deferred").
    kind: str

    def claim(
        self, conn: Connection, want: int, now: datetime, until: datetime
    ) -> list[Claim[K, U]]:
        """Take up to ``want`` waiting units under leases that run ``until``."""
        ...

    def renew(
        self, conn: Connection, held: Mapping[K, Lease], now: datetime, until: datetime
    ) -> Renewal:
        """Extend the leases held; whether to go on claiming, stop, or stop as it is lost."""
        ...

    def record(
        self,
        conn: Connection,
        held: Mapping[K, Lease],
        results: Sequence[R_contra],
        now: datetime,
    ) -> int:
        """Write finished units (each still under its claim); how many were written."""
        ...

    def mark_sent(self, conn: Connection, held: Mapping[K, Lease], now: datetime) -> set[K]:
        """Record these units sent, durably, just before their calls; the keys still ours."""
        ...

    def requeue(self, conn: Connection, held: Mapping[K, Lease], now: datetime) -> int:
        """These claimed units' calls never left: they wait again (their claims end).

        Only ``Unsent`` units come here: never marked, or marked and then refused
        at the connection (``UpstreamUnreachable``), so their sent mark is taken
        back too.
        """
        ...

    def let_go(self, conn: Connection, held: Mapping[K, Lease] | None, now: datetime) -> Recovered:
        """End claims: sent units become ``uncertain``, unsent ones wait again.

        ``held`` None: every claim whose holder stopped renewing it (recovery);
        otherwise this holder's own claims, whose calls a drain cut off (it
        also releases whatever lease the holder keeps over them).
        """
        ...

    def lapsed(self, conn: Connection, now: datetime) -> bool:
        """A cheap read first: is any claim lapsed (so an idle worker writes nothing)?"""
        ...


def uncertain_detail(name: str, keys: Sequence[Any], *, cut_off: bool) -> dict[str, Any]:
    """What an ``uncertain`` activity record says: which units (the first 100), how many, why."""
    detail: dict[str, Any] = {name: list(keys)[:100], "count": len(keys)}
    if cut_off:
        detail["reason"] = "the worker stopped (its grace period ended) during the calls"
    return detail


def count_recovered(metrics: Recorder, kind: str, recovered: Recovered, *, lapsed: bool) -> None:
    """Count recovered claims one way for every kind: each ended lease, each uncertain unit."""
    if lapsed:
        metrics.leases_recovered(kind, recovered.leases)
    metrics.uncertain(kind, recovered.uncertain)


async def recover_lapsed(
    db: Database, clock: Clock, metrics: Recorder, queue: LeaseQueue[Any, Any, Any]
) -> Recovered:
    """The claims of workers that stopped: sent units ``uncertain``, unsent ones waiting again."""
    now = clock.now()
    if not await db.read(lambda c: queue.lapsed(c, now)):
        return Recovered()
    recovered = await db.transact(lambda c: queue.let_go(c, None, now))
    count_recovered(metrics, queue.kind, recovered, lapsed=True)
    if recovered.uncertain:
        log.warning(
            "claims of a stopped worker recovered",
            extra={"kind": queue.kind, "uncertain": recovered.uncertain},
        )
    return recovered


# --- the claim pipeline -----------------------------------------------------------------


class Ended(enum.Enum):
    """How a pipeline ended."""

    #: Nothing more to claim, or told to stop: the kind finishes its batch.
    DONE = "done"
    #: A drain: what landed is recorded, the rest handed back for another worker.
    HANDED_OVER = "handed_over"
    #: Another claim holds the scope now: nothing more is written.
    LOST = "lost"


@dataclass
class Ran:
    """What a pipeline did: how it ended, and its answers counted."""

    ended: Ended = Ended.DONE
    answered: int = 0
    failed: int = 0
    unsent: int = 0
    #: Set when ``failure_streak`` failures in a row stopped it: the last one.
    streak_error: BatchyardError | None = None
    streak: int = 0


@dataclass
class Pipeline:
    """Claim → send → record over a ``LeaseQueue``, ``width`` calls in flight.

    Commits are pipelined with the calls: while one transaction records
    finished units, renews the leases and claims the next ones, the calls
    still in flight go on, so the engine's slots stay busy and each commit
    covers many units. A step is due when a quarter of the slots are free, or
    every ``flush_s`` (or ``renew_s``, whichever is sooner) of the clock.
    """

    db: Database
    clock: Clock
    metrics: Recorder
    #: How long a lease runs without renewal.
    lease_s: float
    #: Leases are renewed at least this often.
    renew_s: float
    #: Finished units are recorded at least this often.
    flush_s: float
    #: True once the worker drains: claim nothing more, send nothing more.
    draining: Callable[[], bool]
    #: How long a unit waits (on the clock) after an outage kept its call from starting.
    outage_pause_s: float = 1.0
    #: How many times a unit's call is made again after an upstream 503 that took nothing.
    unavailable_retries: int = 0

    def _until(self) -> datetime:
        return self.clock.now() + timedelta(seconds=self.lease_s)

    async def run(
        self,
        queue: LeaseQueue[K, U, R],
        *,
        width: int,
        call: Callable[[U, OnSend], Awaitable[Any]],
        render: Callable[[U, Answered[Any] | Failed], R],
        failure_streak: int | None = None,
    ) -> Ran:
        """Answer every unit the queue gives until it has none, is stopped, or drains."""
        width = max(1, width)
        interval = min(self.renew_s, self.flush_s)
        clock = self.clock
        ran = Ran()
        # This holder's claims (key → lease): units in flight or claimed and waiting.
        held: dict[K, Lease] = {}
        flying: dict[asyncio.Task[Answered[Any] | Failed | Unsent], Claim[K, U]] = {}
        stepping: asyncio.Task[tuple[Renewal, list[Claim[K, U]]] | None] | None = None
        done: list[tuple[K, R]] = []
        unsent: list[K] = []
        stop = exhausted = False
        asked, last_step = 0, float("-inf")

        def stopping() -> bool:
            return stop or self.draining()

        def write_sent(keys: list[K], now: datetime) -> Callable[[Connection], set[K]]:
            mine = {k: held[k] for k in keys if k in held}  # on the loop, not the db thread
            return lambda c: queue.mark_sent(c, mine, now)

        marks: SentMarks[K] = SentMarks(self.db, clock, write_sent)

        def start(claim: Claim[K, U]) -> None:
            async def mark() -> None:
                if stopping():
                    raise NotSent("the worker is stopping")
                if not await marks.mark(claim.key):
                    raise NotSent("the unit is no longer this worker's")

            task = asyncio.create_task(
                answer(
                    lambda on_send: call(claim.unit, on_send),
                    mark,
                    clock=clock,
                    outage_pause_s=self.outage_pause_s,
                    unavailable_retries=self.unavailable_retries,
                )
            )
            flying[task] = claim

        try:
            while True:
                idle = stopping() or exhausted
                if stepping is None:
                    due = clock.time() - last_step >= interval
                    claim_more = not idle and len(flying) <= width - max(1, width // 4)
                    if claim_more or due or ((done or unsent) and not flying):
                        asked = 0 if idle else width - len(flying)
                        stepping = asyncio.create_task(self._step(queue, held, done, unsent, asked))
                        done, unsent, last_step = [], [], clock.time()
                    elif idle and not flying:
                        break
                waiting: set[asyncio.Task[Any]] = set(flying)
                if stepping is not None:
                    waiting.add(stepping)
                timeout = max(0.0, last_step + interval - clock.time())
                finished, _ = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in finished:
                    if task is stepping:
                        stepping = None
                        step = task.result()
                        if step is None:
                            ran.ended = Ended.LOST
                            return ran
                        renewal, claimed = step
                        stop = stop or renewal is Renewal.STOPPING
                        exhausted = exhausted or (asked > 0 and len(claimed) < asked)
                        for claim in claimed:
                            start(claim)
                        continue
                    claim = flying.pop(task)
                    result = task.result()
                    if isinstance(result, Unsent):
                        ran.unsent += 1
                        unsent.append(claim.key)
                        stop = stop or result.stop
                        exhausted = False  # it waits again: the queue is not done with it
                        continue
                    done.append((claim.key, render(claim.unit, result)))
                    if isinstance(result, Failed):
                        ran.failed += 1
                        ran.streak += 1
                        if failure_streak and ran.streak >= failure_streak and not stop:
                            ran.streak_error = result.error
                            stop = True
                    else:
                        ran.answered += 1
                        ran.streak = 0
        except asyncio.CancelledError:
            if self.draining():
                # Cut off by the end of a drain's grace period: record what landed, and
                # let go of the rest (sent: uncertain; unsent: waiting again) at once.
                for task, claim in flying.items():
                    if task.done() and not task.cancelled():
                        result = task.result()
                        if isinstance(result, Unsent):
                            unsent.append(claim.key)
                        else:
                            done.append((claim.key, render(claim.unit, result)))
                    else:
                        task.cancel()
                if stepping is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(stepping)
                    stepping = None
                await asyncio.shield(self._hand_over(queue, held, done, unsent))
            raise
        finally:
            for task in flying:
                task.cancel()
            if stepping is not None:
                stepping.cancel()
        if self.draining() and not stop and not exhausted:
            # Every call in flight landed: hand the rest over with what landed recorded.
            await self._hand_over(queue, held, done, unsent)
            ran.ended = Ended.HANDED_OVER
        return ran

    async def _step(
        self,
        queue: LeaseQueue[K, U, R],
        held: dict[K, Lease],
        done: list[tuple[K, R]],
        unsent: list[K],
        want: int,
    ) -> tuple[Renewal, list[Claim[K, U]]] | None:
        """Record finished units, hand back unsent ones, renew, claim more: one transaction.

        ``held`` is the pipeline's own: units recorded or handed back leave it
        once the transaction commits, claimed ones join it. None: lost.
        """
        now, until = self.clock.now(), self._until()
        claims = dict(held)
        results = [r for _, r in done]
        back = {k: claims[k] for k in unsent if k in claims}

        def tx(c: Connection) -> tuple[Renewal, int, list[Claim[K, U]]]:
            renewal = queue.renew(c, claims, now, until)
            if renewal is Renewal.LOST:
                return renewal, 0, []
            recorded = queue.record(c, claims, results, now)
            queue.requeue(c, back, now)
            going = renewal is Renewal.GOING and want > 0
            return renewal, recorded, queue.claim(c, want, now, until) if going else []

        # Finished units are answers already paid for upstream: record them through a
        # short storage outage rather than lose them (and make them uncertain).
        renewal, recorded, claimed = await asyncio.shield(
            self.db.transact_through(tx, patience_s=10.0)
        )
        if renewal is Renewal.LOST:
            return None
        if recorded < len(results):
            # Their leases lapsed (or were claimed again): another claim decides them.
            log.warning(
                "leases lost before their results were written",
                extra={"kind": queue.kind, "units": len(results) - recorded},
            )
        for key, _ in done:
            held.pop(key, None)
        for key in unsent:
            held.pop(key, None)
        held.update((claim.key, claim.lease) for claim in claimed)
        return renewal, claimed

    async def _hand_over(
        self,
        queue: LeaseQueue[K, U, R],
        held: dict[K, Lease],
        done: list[tuple[K, R]],
        unsent: list[K],
    ) -> None:
        """Record what landed and let go of the rest (sent: uncertain; unsent: waiting)."""
        now, until = self.clock.now(), self._until()
        results = [r for _, r in done]
        finished = {k for k, _ in done}
        back = {k: held[k] for k in unsent if k in held}
        rest = {k: lease for k, lease in held.items() if k not in finished and k not in back}

        def tx(c: Connection) -> Recovered:
            if queue.renew(c, held, now, until) is Renewal.LOST:
                return Recovered()  # no longer ours: its new holder decides
            queue.record(c, held, results, now)
            queue.requeue(c, back, now)
            return queue.let_go(c, rest, now)

        try:
            recovered = await self.db.transact(tx)
        except BatchyardError:
            log.warning("could not hand work over", extra={"kind": queue.kind})
            return
        held.clear()
        count_recovered(self.metrics, queue.kind, recovered, lapsed=False)
