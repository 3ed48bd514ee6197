"""Every rate limit in batchyard, as one abstraction: GCRA cells checked together.

An organisation's tier (requests, input tokens, estimate tokens and batch
submissions per minute) and an upstream route's limits (requests and tokens per
minute) are all the same thing: a rate with a small burst tolerance. GCRA keeps
one number per limit, its *theoretical arrival time* (TAT): the moment the
schedule would be caught up if every admitted unit had been spread evenly at the
limit's rate. That makes every check O(1), shared state a single float per key,
and pacing exact: at 60/min with a burst of 1, requests go out one a second from
the first second, not sixty at once and then nothing for a minute.

The arithmetic lives in small pure functions here (``cell_for``, ``gcra``,
``gcra_many``, ``gcra_adjust``, ``gcra_penalize``). ``InMemoryLimiter`` and
``SqlLimiter`` call them directly; ``RedisLimiter`` runs the same steps in Lua
so a multi-limit check is one atomic round trip, and the shared contract tests
hold all three to the same behaviour. See docs/explanation/limits.md.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from batchyard.core.clock import Clock
from batchyard.errors import RateLimited

__all__ = [
    "EPSILON",
    "MAX_QUEUE_S",
    "PENALTY",
    "PLACE_SLACK_S",
    "RETRY_AFTER_MAX_S",
    "Admission",
    "Cell",
    "InMemoryLimiter",
    "Limit",
    "Limiter",
    "LimiterBase",
    "RateLimitSignal",
    "SlotGrant",
    "Standing",
    "cell_for",
    "gcra",
    "gcra_adjust",
    "gcra_many",
    "gcra_penalize",
    "line_horizon",
    "line_signature",
    "new_slot_token",
    "penalty_until",
    "retry_for_place",
    "settle",
    "settle_in_line",
    "standing_of",
    "storage_keys",
]

logger = logging.getLogger(__name__)

# Slack on time comparisons. Epoch seconds near 1.8e9 carry about 2.4e-7 s of
# float resolution, so a waiter that sleeps exactly ``retry_after`` could land a
# rounding error short and be told to wait a tenth of a microsecond more.
EPSILON = 1e-6

# The pseudo-limit that holds an upstream's "not before" time for a key. It is a
# GCRA cell with zero increment and zero tolerance, so it admits exactly when
# its TAT has passed and every check of the key honours it. The "!" keeps it
# apart from real limit names, which may not start with one.
PENALTY = "!penalty"

#: The furthest ahead a waiter with no deadline of its own takes a slot, in
#: seconds (a finite stand-in for "forever" that every backend can store).
MAX_QUEUE_S = 1e6

#: How much of the server's queue a place's ``Retry-After`` leaves unused, so a
#: caller back a little early (a replica whose clock runs ahead) still finds
#: its place due: it waits that much longer on the server instead.
PLACE_SLACK_S = 1.0

#: The longest ``Retry-After`` clients honour as sent: the ``openai`` SDK (and
#: the libraries built on it) fall back to their own short back-off above 60 s,
#: so a place in line further ahead than this plus the server's queue would be
#: missed by its holder.
RETRY_AFTER_MAX_S = 60.0


@dataclass(frozen=True, slots=True)
class RateLimitSignal:
    """What an upstream said about its own limits (its ``x-ratelimit-*`` headers).

    Engines read it off each answer; the limiter turns an exhausted allowance
    into a penalty on the route, so every caller of that route waits it out.
    """

    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None
    limit_requests: int | None = None
    limit_tokens: int | None = None


@dataclass(frozen=True)
class Limit:
    """A rate: ``per_minute`` units of cost, with ``burst`` units of slack.

    ``burst`` is how far ahead of the even schedule a caller may get, in units
    of cost. It defaults to 1 so traffic is spread from the first second. A
    single request may always cost more than ``burst`` (a long prompt against a
    tokens-per-minute limit): the tolerance actually applied to a request is
    ``max(burst, cost)``, which admits it once the schedule has caught up rather
    than never.
    """

    name: str
    per_minute: float
    burst: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or self.name.startswith("!") or ":" in self.name:
            raise ValueError(f"invalid limit name {self.name!r}")
        if not (self.per_minute > 0 and math.isfinite(self.per_minute)):
            raise ValueError(f"limit {self.name}: per_minute must be positive and finite")
        if not (self.burst >= 0 and math.isfinite(self.burst)):
            raise ValueError(f"limit {self.name}: burst must be non-negative and finite")

    @property
    def interval(self) -> float:
        """Seconds of schedule one unit of cost occupies."""
        return 60.0 / self.per_minute


@dataclass(frozen=True, slots=True)
class Standing:
    """Where one limit stands for a key after a check: OpenAI's ``x-ratelimit-*`` trio.

    ``remaining`` is how many more units of cost would be admitted right now
    without waiting; ``reset_s`` is how long until the limit is idle again
    (its whole burst available).
    """

    name: str
    limit: float
    remaining: float
    reset_s: float


@dataclass(frozen=True)
class Admission:
    """The limiter's verdict: admitted, or how long until the same request would be.

    ``limit`` names the limit that bound (``PENALTY`` for an upstream's back-off)
    so an API answer can say which one; it is ``None`` when admitted.
    ``delay`` is set when a check asked for ``max_delay``: the request was
    admitted into a slot that starts that many seconds from now (its place in
    the schedule is already taken, so it goes first when the time comes).
    ``standing`` says where each limit stands after the check.
    """

    allowed: bool
    retry_after: float
    limit: str | None = None
    delay: float = field(default=0.0, compare=False)
    standing: tuple[Standing, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class Cell:
    """One limit's share of one request, in seconds of that limit's schedule."""

    increment: float
    tolerance: float


PENALTY_CELL = Cell(0.0, 0.0)


def cell_for(limit: Limit, cost: float) -> Cell:
    if not (cost >= 0 and math.isfinite(cost)):
        raise ValueError(f"limit {limit.name}: cost must be non-negative and finite")
    return Cell(cost * limit.interval, max(limit.burst, cost) * limit.interval)


def gcra(tat: float, now: float, cell: Cell) -> tuple[float, float]:
    """The TAT after admitting, and the wait before admission is allowed.

    A wait at or below ``EPSILON`` means admit now. A TAT in the past means the
    limit is idle, which is why a missing key is simply TAT 0.
    """
    new_tat = max(tat, now) + cell.increment
    return new_tat, new_tat - cell.tolerance - now


def gcra_many(
    tats: Sequence[float], now: float, cells: Sequence[Cell]
) -> tuple[float, int, list[float]]:
    """Check several cells at once: (wait, index of the binding cell, new TATs).

    All or nothing: the caller writes the new TATs only when ``wait <=
    EPSILON``. The wait is the largest single wait, because each cell's wait
    depends on its own TAT alone, so after that long every cell admits.
    """
    wait, binding, new_tats = 0.0, -1, []
    for i, (tat, cell) in enumerate(zip(tats, cells, strict=True)):
        new_tat, w = gcra(tat, now, cell)
        new_tats.append(new_tat)
        if w > wait:
            wait, binding = w, i
    return wait, binding, new_tats


def gcra_adjust(tat: float, now: float, increment: float) -> float:
    """Move a TAT by a correction once real usage is known.

    A refund can take a limit back to idle but no further: unused reservation
    that has already drained with time is not credit to spend later.
    """
    return max(max(tat, now) + increment, now)


def gcra_penalize(tat: float, until: float) -> float:
    """The penalty cell's TAT only ever moves later: the longest back-off wins."""
    return max(tat, until)


def storage_keys(key: str, limits: Sequence[tuple[Limit, float]]) -> list[str]:
    """The per-limit keys for a request, penalty first; rejects a name twice."""
    names = [limit.name for limit, _ in limits]
    if len(set(names)) != len(names):
        raise ValueError(f"limits for {key} repeat a name: {names}")
    return [f"{key}:{PENALTY}", *(f"{key}:{name}" for name in names)]


def request_cells(limits: Sequence[tuple[Limit, float]]) -> list[Cell]:
    """The cells matching ``storage_keys``, penalty first."""
    return [PENALTY_CELL, *(cell_for(limit, cost) for limit, cost in limits)]


def binding_name(limits: Sequence[tuple[Limit, float]], index: int) -> str | None:
    if index < 0:
        return None
    return PENALTY if index == 0 else limits[index - 1][0].name


def standing_of(
    limits: Sequence[tuple[Limit, float]], tats: Sequence[float], now: float
) -> tuple[Standing, ...]:
    """Each limit's standing from its TAT (``tats`` in ``storage_keys`` order, penalty first)."""
    out = []
    for (limit, _), tat in zip(limits, tats[1:], strict=True):
        ahead = max(0.0, tat - now)
        remaining = max(0.0, (limit.burst * limit.interval - ahead) / limit.interval)
        out.append(Standing(limit.name, limit.per_minute, math.floor(remaining + EPSILON), ahead))
    return tuple(out)


def settle(
    limits: Sequence[tuple[Limit, float]],
    cells: Sequence[Cell],
    tats: Sequence[float],
    now: float,
    max_delay: float,
) -> tuple[Admission, list[float] | None]:
    """The verdict on one check over current ``tats``, and the TATs to write if admitted.

    Shared by every backend that computes in Python (Redis repeats it in Lua).
    A wait up to ``max_delay`` admits into a future slot: the TATs move as for
    any admission, and the caller waits ``delay`` before going on.
    """
    wait, binding, new_tats = gcra_many(tats, now, cells)
    if wait > max_delay + EPSILON:
        return Admission(
            False, wait, binding_name(limits, binding), 0.0, standing_of(limits, tats, now)
        ), None
    written = [n if c.increment > 0 else t for t, c, n in zip(tats, cells, new_tats, strict=True)]
    delay = wait if wait > EPSILON else 0.0
    return Admission(True, 0.0, None, delay, standing_of(limits, written, now)), written


def line_signature(limits: Sequence[tuple[Limit, float]]) -> str:
    """The line a refused request waits in: its limits and their costs.

    A place in line is taken back only by a request with the same costs (its
    own retry, as a rule), so a small request's place never admits a large one.
    """
    return "|".join(f"{limit.name}={cost!r}" for limit, cost in limits)


def line_horizon(max_delay: float) -> float:
    """How far ahead a refused request may be given a place in line.

    Its ``Retry-After`` is ``retry_for_place``'s (it comes back in time to
    wait the rest on the server), and clients honour at most
    ``RETRY_AFTER_MAX_S`` of it.
    """
    return RETRY_AFTER_MAX_S + max_delay - min(PLACE_SLACK_S, max_delay)


def retry_for_place(wait: float, max_delay: float) -> float:
    """The ``retry_after`` of a place ``wait`` seconds ahead: early enough to wait the rest here.

    It comes back when the place is ``max_delay`` away less ``PLACE_SLACK_S``
    (a second of margin, where the queue is that long), so it takes the place
    and the server holds it for what is left.
    """
    margin = min(PLACE_SLACK_S, max_delay)
    return max(wait - max_delay + margin, EPSILON)


def settle_in_line(
    limits: Sequence[tuple[Limit, float]],
    cells: Sequence[Cell],
    tats: Sequence[float],
    places: Sequence[float],
    now: float,
    max_delay: float,
    hold_s: float,
) -> tuple[Admission, list[float] | None, float | None, float | None]:
    """``settle`` with a line: (verdict, TATs to write, place taken back, place given).

    ``places`` are the times of the places in line already given (unexpired,
    earliest first) for these limits and costs. The earliest one due within
    ``max_delay`` is taken back: the request is admitted into it (its share of
    every limit was counted when the place was given), after any penalty.
    Otherwise the check is ``settle``'s; a refusal within the line's horizon
    takes the refused request's slot in the schedule now (the TATs move as for
    an admission) and gives it that place, so the next refused request is told
    a later time rather than the same one. Its ``retry_after`` is the place
    less most of ``max_delay`` (``retry_for_place``): it comes back in time to
    take it and waits the rest on the server.
    """
    if places and places[0] <= now + max_delay + EPSILON:
        penalty = max(0.0, tats[0] - now) if tats else 0.0
        delay = max(places[0] - now, penalty, 0.0)
        standing = standing_of(limits, tats, now)
        if delay > max_delay + EPSILON:
            return Admission(False, delay, PENALTY, 0.0, standing), None, None, None
        admitted = Admission(True, 0.0, None, delay if delay > EPSILON else 0.0, standing)
        return admitted, None, places[0], None
    admission, written = settle(limits, cells, tats, now, max_delay)
    if admission.allowed or hold_s <= 0 or admission.limit == PENALTY:
        return admission, written, None, None
    wait, _, new_tats = gcra_many(tats, now, cells)
    if wait > line_horizon(max_delay) + EPSILON:
        return admission, None, None, None
    kept = [n if c.increment > 0 else t for t, c, n in zip(tats, cells, new_tats, strict=True)]
    place = now + wait
    refused = Admission(
        False,
        retry_for_place(wait, max_delay),
        admission.limit,
        0.0,
        standing_of(limits, kept, now),
    )
    return refused, kept, None, place


def penalty_until(
    signal: RateLimitSignal, now: float, *, default_reset_s: float = 1.0
) -> float | None:
    """When an upstream's own headers say to hold off, as an epoch time.

    An exhausted request or token allowance (``x-ratelimit-remaining-* == 0``)
    holds the route until the matching reset; an upstream that says "none left"
    without a reset gets ``default_reset_s``, since sending at once is sure to
    fail. ``None`` when nothing is exhausted.
    """
    until: float | None = None
    pairs = (
        (signal.remaining_requests, signal.reset_requests_s),
        (signal.remaining_tokens, signal.reset_tokens_s),
    )
    for remaining, reset in pairs:
        if remaining is not None and remaining <= 0:
            at = now + (reset if reset is not None else default_reset_s)
            until = at if until is None else max(until, at)
    return until


@dataclass(frozen=True, slots=True)
class SlotGrant:
    """A concurrency check: the lease's token when a slot was free, and how many are taken."""

    token: str | None
    in_use: int


#: Between two looks at a shared slot count while waiting for one; a slot freed in
#: this process wakes its waiters at once.
SLOT_POLL_S = 0.05


@runtime_checkable
class Limiter(Protocol):
    """What the API and the dispatcher hold; in-process or shared alike."""

    async def try_acquire(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        *,
        max_delay: float = 0.0,
        hold_s: float = 0.0,
    ) -> Admission:
        """Admit ``cost`` against every limit under ``key``, or none of them.

        A request that would be admitted within ``max_delay`` seconds is admitted
        now into that later slot (``Admission.delay``); the caller waits it out.
        With ``hold_s`` a refused request is given a place in line (see
        ``settle_in_line``), held for ``hold_s`` seconds past its time.
        """
        ...

    async def acquire(
        self, key: str, limits: Sequence[tuple[Limit, float]], *, max_wait: float | None = None
    ) -> None:
        """Wait (on the clock) until admitted; ``RateLimited`` past ``max_wait``."""
        ...

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        """Correct a reservation by ``delta`` units: negative refunds."""
        ...

    async def penalize(self, key: str, until: float) -> None:
        """Admit nothing under ``key`` before epoch time ``until``."""
        ...

    async def observe(self, key: str, signal: RateLimitSignal) -> None:
        """Feed an upstream's ``x-ratelimit-*`` signal into ``penalize``."""
        ...

    async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
        """Take one of ``capacity`` concurrency slots under ``key`` for ``lease_s`` seconds.

        Slots are leases: one whose holder died (a crashed process) frees itself
        when its lease runs out, so nothing leaks slots forever.
        """
        ...

    async def renew_slot(self, key: str, token: str, lease_s: float) -> None:
        """Extend a held slot's lease to ``lease_s`` from now."""
        ...

    async def free_slot(self, key: str, token: str) -> None:
        """Give a slot back."""
        ...

    async def occupy(
        self, key: str, capacity: int, lease_s: float, *, max_wait: float = 0.0
    ) -> SlotGrant:
        """``take_slot``, waiting up to ``max_wait`` seconds for one to free up."""
        ...

    async def close(self) -> None: ...


class LimiterBase:
    """Waiting, slot queues and signal handling, written once over the backend's steps."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._slot_freed: dict[str, asyncio.Event] = {}

    async def try_acquire(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        *,
        max_delay: float = 0.0,
        hold_s: float = 0.0,
    ) -> Admission:
        raise NotImplementedError

    async def penalize(self, key: str, until: float) -> None:
        raise NotImplementedError

    async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
        raise NotImplementedError

    async def renew_slot(self, key: str, token: str, lease_s: float) -> None:
        raise NotImplementedError

    async def _free_slot(self, key: str, token: str) -> None:
        raise NotImplementedError

    async def free_slot(self, key: str, token: str) -> None:
        await self._free_slot(key, token)
        event = self._slot_freed.pop(key, None)
        if event is not None:
            event.set()

    async def occupy(
        self, key: str, capacity: int, lease_s: float, *, max_wait: float = 0.0
    ) -> SlotGrant:
        # A slot freed in this process wakes the waiters at once; one freed by
        # another process (or by a lease running out) is seen at the next poll.
        # The wake-up is registered before the attempt: a slot freed while the
        # attempt is on its way to the store sets it, and is not missed.
        deadline = self._clock.time() + max_wait
        while True:
            event = self._slot_freed.setdefault(key, asyncio.Event())
            grant = await self.take_slot(key, capacity, lease_s)
            left = deadline - self._clock.time()
            if grant.token is not None or left <= EPSILON:
                return grant
            waiter = asyncio.ensure_future(event.wait())
            sleeper = asyncio.ensure_future(self._clock.sleep(min(SLOT_POLL_S, left)))
            try:
                await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                sleeper.cancel()

    async def acquire(
        self, key: str, limits: Sequence[tuple[Limit, float]], *, max_wait: float | None = None
    ) -> None:
        # A waiter takes its place in the schedule at once (a slot up to the
        # time it may still wait) and sleeps once until that slot: a thousand
        # waiters cost a thousand checks, not a thousand checks per interval,
        # and they go in the order they came. Refused only when even the
        # latest slot it would accept is too late (a long penalty, or
        # ``max_wait``): such an attempt consumes nothing, and it sleeps the
        # advised time and asks again.
        start = self._clock.time()
        while True:
            waited = self._clock.time() - start
            budget = MAX_QUEUE_S if max_wait is None else max(0.0, max_wait - waited)
            admission = await self.try_acquire(key, limits, max_delay=budget)
            if admission.allowed:
                if admission.delay > 0:
                    await self._wait_for_slot(key, limits, admission.delay)
                return
            if max_wait is not None and waited + admission.retry_after > max_wait + EPSILON:
                raise RateLimited(
                    f"rate limit {admission.limit} for {key} reached",
                    retry_after=admission.retry_after,
                )
            await self._clock.sleep(admission.retry_after)

    async def _wait_for_slot(
        self, key: str, limits: Sequence[tuple[Limit, float]], delay: float
    ) -> None:
        """Sleep until a slot taken ahead of time; a penalty that came meanwhile holds it too.

        A waiter cancelled before its slot gives the slot back, so a caller
        that went away does not leave a hole in the schedule.
        """
        try:
            await self._clock.sleep(delay)
        except BaseException:
            for limit, cost in limits:
                await asyncio.shield(self.adjust(key, limit, -cost))
            raise
        while True:
            # Only the penalty: the slot itself is already ours.
            penalty = await self.try_acquire(key, ())
            if penalty.allowed:
                return
            await self._clock.sleep(penalty.retry_after)

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        raise NotImplementedError

    async def observe(self, key: str, signal: RateLimitSignal) -> None:
        until = penalty_until(signal, self._clock.time())
        if until is not None:
            await self.penalize(key, until)

    async def close(self) -> None:
        return None


def new_slot_token() -> str:
    return uuid.uuid4().hex


def log_penalty(key: str, until: float, now: float) -> None:
    logger.info(
        "rate limit penalty",
        extra={"limit_key": key, "until": until, "seconds": round(until - now, 3)},
    )


class InMemoryLimiter(LimiterBase):
    """The default: one process, state in a dict.

    Each operation reads and writes its TATs without awaiting in between, so
    it is atomic under asyncio; a lock makes it safe from threads as well.
    Idle keys are dropped now and then, since an idle TAT means the same as a
    missing one.
    """

    _SWEEP_EVERY = 4096

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self._tats: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}
        # Places in line by line (key and signature): their times, earliest first.
        self._lines: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._ops = 0

    async def try_acquire(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        *,
        max_delay: float = 0.0,
        hold_s: float = 0.0,
    ) -> Admission:
        keys = storage_keys(key, limits)
        cells = request_cells(limits)
        now = self._clock.time()
        with self._lock:
            self._maybe_sweep(now)
            tats = [self._tats.get(k, 0.0) for k in keys]
            if hold_s > 0 and limits:
                line_key = f"{key}:!line:{line_signature(limits)}"
                places = [p for p in self._lines.get(line_key, []) if p >= now - hold_s]
                admission, written, taken, given = settle_in_line(
                    limits, cells, tats, places, now, max_delay, hold_s
                )
                if taken is not None:
                    places.remove(taken)
                if given is not None:
                    bisect.insort(places, given)
                if places:
                    self._lines[line_key] = places
                else:
                    self._lines.pop(line_key, None)
            else:
                admission, written = settle(limits, cells, tats, now, max_delay)
            if written is not None:
                for k, cell, new_tat in zip(keys, cells, written, strict=True):
                    if cell.increment > 0:
                        self._tats[k] = new_tat
        return admission

    async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
        now = self._clock.time()
        with self._lock:
            leases = self._slots.setdefault(key, {})
            for token in [t for t, until in leases.items() if until <= now]:
                del leases[token]
            if len(leases) >= capacity:
                return SlotGrant(None, len(leases))
            token = new_slot_token()
            leases[token] = now + lease_s
            return SlotGrant(token, len(leases))

    async def renew_slot(self, key: str, token: str, lease_s: float) -> None:
        with self._lock:
            leases = self._slots.get(key)
            if leases is not None and token in leases:
                leases[token] = self._clock.time() + lease_s

    async def _free_slot(self, key: str, token: str) -> None:
        with self._lock:
            leases = self._slots.get(key)
            if leases is not None:
                leases.pop(token, None)
                if not leases:
                    del self._slots[key]

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        k = f"{key}:{limit.name}"
        now = self._clock.time()
        with self._lock:
            self._tats[k] = gcra_adjust(self._tats.get(k, 0.0), now, delta * limit.interval)

    async def penalize(self, key: str, until: float) -> None:
        k = f"{key}:{PENALTY}"
        with self._lock:
            self._tats[k] = gcra_penalize(self._tats.get(k, 0.0), until)
        log_penalty(key, until, self._clock.time())

    def _maybe_sweep(self, now: float) -> None:
        self._ops += 1
        if self._ops % self._SWEEP_EVERY == 0:
            self._tats = {k: t for k, t in self._tats.items() if t > now}
            self._lines = {k: v for k, v in self._lines.items() if v and v[-1] > now - 3600}
