"""One behavioural contract for every limiter: in-process, Redis, PostgreSQL, SQLite.

The shared limiters run against the real servers on loopback. Each test gets
its own key namespace (and its own Redis prefix); the SQL table lives in a
schema of its own so it never meets the store's migrations. Time is a
ManualClock passed to the limiter, which the shared limiters send to the server
as ``now``: nothing here sleeps to test a time rule.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from batchyard.app import limiter_from_url
from batchyard.core.clock import ManualClock
from batchyard.core.limits import PENALTY, PLACE_SLACK_S, Admission, InMemoryLimiter, Limit
from batchyard.engines.protocol import RateLimitSignal
from batchyard.errors import RateLimited
from batchyard.store.redis_limiter import RedisLimiter
from batchyard.store.sql_limiter import SqlLimiter
from batchyard.store.tables import rate_limits
from tests.support.clocks import SleepWatchingClock
from tests.support.waits import HANG_S, settles

REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SCHEMA = "batchyard_limits_test"
SRC = Path(__file__).resolve().parents[2] / "src"

RPM = Limit("rpm", per_minute=60)
TPM = Limit("tpm", per_minute=6000, burst=100)


def postgres_engine() -> sa.Engine:
    engine = sa.create_engine(POSTGRES_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
    return engine.execution_options(schema_translate_map={None: SCHEMA})


@pytest.fixture(scope="module")
def pg_engine() -> Iterator[sa.Engine]:
    engine = postgres_engine()
    rate_limits.create(engine, checkfirst=True)
    yield engine
    engine.dispose()


@pytest.fixture
def ns() -> str:
    return f"t{uuid.uuid4().hex[:12]}."


@pytest.fixture
def clock() -> SleepWatchingClock:
    return SleepWatchingClock()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
        "sqlite",
    ]
)
async def limiter(request, clock, ns, tmp_path) -> AsyncIterator[object]:
    if request.param == "memory":
        lim = InMemoryLimiter(clock)
        yield lim
        await lim.close()
    elif request.param == "redis":
        prefix = f"batchyard-test:{ns}"
        lim = RedisLimiter(REDIS_URL, clock, prefix=prefix)
        yield lim
        await lim.close()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
    elif request.param == "postgres":
        engine = request.getfixturevalue("pg_engine")
        lim = SqlLimiter(engine, clock)
        yield lim
        await lim.close()
        with engine.begin() as conn:
            conn.execute(sa.delete(rate_limits).where(rate_limits.c.key.startswith(ns)))
    else:
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'limits.db'}")
        rate_limits.create(engine, checkfirst=True)
        lim = SqlLimiter(engine, clock)
        yield lim
        await lim.close()
        engine.dispose()


# -- the contract -------------------------------------------------------------


async def test_even_spacing_from_the_first_second(limiter, clock, ns) -> None:
    assert await limiter.try_acquire(f"{ns}org:a", [(RPM, 1)]) == Admission(True, 0.0)
    second = await limiter.try_acquire(f"{ns}org:a", [(RPM, 1)])
    assert second == Admission(False, pytest.approx(1.0), "rpm")
    clock.advance(1.0)
    assert (await limiter.try_acquire(f"{ns}org:a", [(RPM, 1)])).allowed


async def test_no_full_bucket_at_start_and_burst_is_honoured(limiter, clock, ns) -> None:
    admitted = [(await limiter.try_acquire(f"{ns}org:a", [(RPM, 1)])).allowed for _ in range(10)]
    assert admitted.count(True) == 1
    burst5 = Limit("rpm", per_minute=60, burst=5)
    admitted = [(await limiter.try_acquire(f"{ns}org:b", [(burst5, 1)])).allowed for _ in range(10)]
    assert admitted.count(True) == 5
    clock.advance(2.0)
    admitted = [(await limiter.try_acquire(f"{ns}org:b", [(burst5, 1)])).allowed for _ in range(10)]
    assert admitted.count(True) == 2


async def test_keys_are_independent(limiter, ns) -> None:
    assert (await limiter.try_acquire(f"{ns}org:a", [(RPM, 1)])).allowed
    assert (await limiter.try_acquire(f"{ns}org:b", [(RPM, 1)])).allowed


async def test_all_or_nothing(limiter, clock, ns) -> None:
    key = f"{ns}org:a"
    assert (await limiter.try_acquire(key, [(TPM, 100)])).allowed
    refused = await limiter.try_acquire(key, [(RPM, 1), (TPM, 100)])
    assert refused == Admission(False, pytest.approx(1.0), "tpm")
    # The refused request took nothing from the request limit.
    assert (await limiter.try_acquire(key, [(RPM, 1)])).allowed


async def test_a_cost_above_burst_waits_for_the_schedule(limiter, clock, ns) -> None:
    key = f"{ns}org:a"
    assert (await limiter.try_acquire(key, [(TPM, 100)])).allowed
    big = await limiter.try_acquire(key, [(TPM, 1000)])
    assert big == Admission(False, pytest.approx(1.0), "tpm")
    clock.advance(1.0)
    assert (await limiter.try_acquire(key, [(TPM, 1000)])).allowed


async def test_refund_and_extra_debit(limiter, clock, ns) -> None:
    key = f"{ns}org:a"
    assert (await limiter.try_acquire(key, [(TPM, 600)])).allowed
    assert (await limiter.try_acquire(key, [(TPM, 100)])).retry_after == pytest.approx(6.0)
    await limiter.adjust(key, TPM, -500)
    assert (await limiter.try_acquire(key, [(TPM, 100)])).retry_after == pytest.approx(1.0)
    await limiter.adjust(key, TPM, 300)
    assert (await limiter.try_acquire(key, [(TPM, 100)])).retry_after == pytest.approx(4.0)
    # A refund larger than the debt only brings the limit back to idle.
    await limiter.adjust(key, TPM, -100_000)
    assert (await limiter.try_acquire(key, [(TPM, 100)])).allowed
    assert not (await limiter.try_acquire(key, [(TPM, 100)])).allowed


async def test_penalize_blocks_the_key_until_then(limiter, clock, ns) -> None:
    key = f"{ns}route:r1"
    await limiter.penalize(key, clock.time() + 20)
    assert await limiter.try_acquire(key, [(RPM, 1)]) == Admission(
        False, pytest.approx(20.0), PENALTY
    )
    assert not (await limiter.try_acquire(key, [])).allowed
    assert (await limiter.try_acquire(f"{ns}route:r2", [(RPM, 1)])).allowed
    await limiter.penalize(key, clock.time() + 5)
    clock.advance(19.5)
    assert (await limiter.try_acquire(key, [(RPM, 1)])).retry_after == pytest.approx(0.5)
    clock.advance(0.5)
    assert (await limiter.try_acquire(key, [(RPM, 1)])).allowed


async def test_observe_reads_exhausted_headers(limiter, clock, ns) -> None:
    key = f"{ns}route:r"
    await limiter.observe(key, RateLimitSignal(remaining_requests=5, reset_requests_s=30))
    assert (await limiter.try_acquire(key, [])).allowed
    await limiter.observe(key, RateLimitSignal(remaining_requests=0, reset_requests_s=2.5))
    assert (await limiter.try_acquire(key, [])).retry_after == pytest.approx(2.5)


async def test_acquire_paces_on_the_clock_and_sees_penalties(limiter, clock, ns) -> None:
    key = f"{ns}route:r"
    await limiter.acquire(key, [(RPM, 1)])
    waiter = asyncio.create_task(limiter.acquire(key, [(RPM, 1)]))
    assert await clock.next_sleep() == pytest.approx(1.0)
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert not waiter.done()
    # An upstream 429 arrives while the waiter sleeps; it wakes, sees it, waits on.
    await limiter.penalize(key, clock.time() + 4.5)
    clock.advance(0.5)
    assert await clock.next_sleep() == pytest.approx(4.0)
    clock.advance(4.0)
    await settles(waiter)


async def test_acquire_refuses_past_max_wait_without_consuming(limiter, clock, ns) -> None:
    key = f"{ns}org:a"
    await limiter.acquire(key, [(RPM, 1)])
    with pytest.raises(RateLimited) as raised:
        await limiter.acquire(key, [(RPM, 1)], max_wait=0.25)
    assert raised.value.retry_after == pytest.approx(1.0)
    assert clock.sleeps == []
    clock.advance(1.0)
    await limiter.acquire(key, [(RPM, 1)], max_wait=0)


async def test_concurrent_tasks_share_one_limit(limiter, clock, ns) -> None:
    limit = Limit("rpm", per_minute=60, burst=3)
    decisions = await asyncio.gather(
        *(limiter.try_acquire(f"{ns}org:a", [(limit, 1)]) for _ in range(12))
    )
    assert sum(d.allowed for d in decisions) == 3


@pytest.mark.redis
@pytest.mark.postgres
async def test_max_delay_admits_into_a_later_slot_in_order(limiter, clock, ns) -> None:
    """A request that would be admitted soon takes its place in the schedule now."""
    key = f"{ns}org:q"
    assert (await limiter.try_acquire(key, [(RPM, 1)], max_delay=5)).delay == 0
    delays = [(await limiter.try_acquire(key, [(RPM, 1)], max_delay=5)).delay for _ in range(5)]
    assert delays == pytest.approx([1, 2, 3, 4, 5])
    late = await limiter.try_acquire(key, [(RPM, 1)], max_delay=5)
    assert late == Admission(False, pytest.approx(6.0), "rpm")


async def test_standing_says_what_is_left_and_when_it_resets(limiter, clock, ns) -> None:
    burst5 = Limit("rpm", per_minute=60, burst=5)
    key = f"{ns}org:s"
    first = await limiter.try_acquire(key, [(burst5, 1), (TPM, 50)])
    rpm, tpm = first.standing
    assert (rpm.name, rpm.limit, rpm.remaining) == ("rpm", 60, 4)
    assert rpm.reset_s == pytest.approx(1.0)
    assert (tpm.name, tpm.remaining) == ("tpm", 50)
    assert tpm.reset_s == pytest.approx(0.5)
    # A look that costs nothing sees the same standing and spends nothing.
    peek = await limiter.try_acquire(key, [(burst5, 0), (TPM, 0)])
    assert peek.standing == first.standing
    for _ in range(4):
        assert (await limiter.try_acquire(key, [(burst5, 1)])).allowed
    refused = await limiter.try_acquire(key, [(burst5, 1)])
    assert not refused.allowed and refused.standing[0].remaining == 0
    assert refused.standing[0].reset_s == pytest.approx(5.0)


async def test_slots_admit_up_to_capacity_and_free_on_release(limiter, clock, ns) -> None:
    key = f"{ns}org:c"
    grants = [await limiter.take_slot(key, 3, 60) for _ in range(4)]
    assert [g.token is not None for g in grants] == [True, True, True, False]
    assert [g.in_use for g in grants] == [1, 2, 3, 3]
    await limiter.free_slot(key, grants[0].token)
    assert (await limiter.take_slot(key, 3, 60)).token is not None
    assert (await limiter.take_slot(f"{ns}org:other", 3, 60)).token is not None


async def test_a_dead_holders_slot_frees_when_its_lease_runs_out(limiter, clock, ns) -> None:
    """A process that crashed holding slots cannot leak them for longer than a lease."""
    key = f"{ns}org:l"
    kept = await limiter.take_slot(key, 2, 60)
    await limiter.take_slot(key, 2, 60)  # its holder dies and never frees it
    assert (await limiter.take_slot(key, 2, 60)).token is None
    clock.advance(40)
    await limiter.renew_slot(key, kept.token, 60)
    clock.advance(21)
    again = await limiter.take_slot(key, 2, 60)
    assert again.token is not None and again.in_use == 2  # the renewed one is still held


async def test_occupy_waits_for_a_slot_freed_in_this_process(limiter, clock, ns) -> None:
    key = f"{ns}org:w"
    held = await limiter.take_slot(key, 1, 60)
    waiter = asyncio.create_task(limiter.occupy(key, 1, 60, max_wait=30))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await limiter.free_slot(key, held.token)
    grant = await settles(waiter)
    assert grant.token is not None
    refused = await limiter.occupy(key, 1, 60, max_wait=0)
    assert refused.token is None and refused.in_use == 1


async def test_limiter_from_url_builds_the_shared_ones(clock, pg_engine) -> None:
    redis_limiter = limiter_from_url(REDIS_URL, clock, pg_engine)
    assert isinstance(redis_limiter, RedisLimiter)
    await redis_limiter.close()
    assert isinstance(limiter_from_url("sql", clock, pg_engine), SqlLimiter)


@pytest.mark.postgres
async def test_prune_drops_idle_rows_and_checks_carry_on(clock, ns, pg_engine) -> None:
    limiter = SqlLimiter(pg_engine, clock)
    key = f"{ns}org:a"
    assert (await limiter.try_acquire(key, [(RPM, 1)])).allowed
    clock.advance(7200)
    assert await limiter.prune(idle_for=3600) >= 1
    with pg_engine.connect() as conn:
        left = conn.execute(
            sa.select(sa.func.count()).where(rate_limits.c.key.startswith(ns))
        ).scalar_one()
    assert left == 0
    assert (await limiter.try_acquire(key, [(RPM, 1)])).allowed
    assert not (await limiter.try_acquire(key, [(RPM, 1)])).allowed
    with pg_engine.begin() as conn:
        conn.execute(sa.delete(rate_limits).where(rate_limits.c.key.startswith(ns)))


@pytest.mark.postgres
async def test_a_check_with_nothing_to_count_locks_and_writes_nothing(clock, ns, pg_engine) -> None:
    """A route with no limits of its own is still asked about its penalty on every call.

    That check only reads: it inserts no row and takes no row lock, so calls
    of one route across a fleet do not queue behind each other on its
    penalty row (a transaction holding that lock does not hold the check up),
    and it still sees a penalty set by another process.
    """
    limiter = SqlLimiter(pg_engine, clock)
    key = f"{ns}route:free"
    assert (await limiter.try_acquire(key, [])).allowed
    with pg_engine.connect() as conn:
        rows = conn.execute(
            sa.select(sa.func.count()).where(rate_limits.c.key.startswith(ns))
        ).scalar_one()
    assert rows == 0
    await limiter.penalize(key, clock.time() + 5)
    with pg_engine.connect() as holder:
        holder.execute(
            sa.select(rate_limits.c.tat)
            .where(rate_limits.c.key == f"{key}:{PENALTY}")
            .with_for_update()
        ).scalar_one()
        # A bound on a hang, not a timing: a locking check would wait for ``holder``.
        admission = await settles(limiter.try_acquire(key, []))
        holder.rollback()
    assert admission == Admission(False, pytest.approx(5.0), PENALTY)
    with pg_engine.begin() as conn:
        conn.execute(sa.delete(rate_limits).where(rate_limits.c.key.startswith(ns)))


@pytest.mark.redis
async def test_redis_keys_expire_once_idle(clock, ns) -> None:
    prefix = f"batchyard-test:{ns}"
    limiter = RedisLimiter(REDIS_URL, clock, prefix=prefix)
    await limiter.try_acquire("org:a", [(TPM, 100)])
    await limiter.penalize("org:a", clock.time() + 30)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        ttls = {k.decode(): client.pttl(k) for k in client.scan_iter(match=f"{prefix}*")}
        # One request's limits share a hash tag, so they share a cluster slot.
        assert set(ttls) == {f"{prefix}{{org:a}}:tpm", f"{prefix}{{org:a}}:!penalty"}
        assert 1000 < ttls[f"{prefix}{{org:a}}:tpm"] <= 2000
        assert 30000 < ttls[f"{prefix}{{org:a}}:!penalty"] <= 31000
    finally:
        await limiter.close()
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


# -- across processes ---------------------------------------------------------

WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from datetime import datetime
    from batchyard.core.clock import ManualClock
    from batchyard.core.limits import Limit

    backend, ns, start = sys.argv[1], sys.argv[2], sys.argv[3]
    clock = ManualClock(datetime.fromisoformat(start))
    if backend == "redis":
        from batchyard.store.redis_limiter import RedisLimiter
        limiter = RedisLimiter("%(redis)s", clock, prefix="batchyard-test:" + ns)
    else:
        import sqlalchemy as sa
        from batchyard.store.sql_limiter import SqlLimiter
        engine = sa.create_engine("%(postgres)s").execution_options(
            schema_translate_map={None: "%(schema)s"}
        )
        limiter = SqlLimiter(engine, clock)
    limit = Limit("rpm", per_minute=60, burst=100)

    async def main():
        print("ready", flush=True)
        sys.stdin.readline()
        admitted = 0
        for phase in range(3):
            for _ in range(%(attempts)d):
                admitted += (await limiter.try_acquire(ns + "org:shared", [(limit, 1)])).allowed
            clock.advance(10)
        await limiter.close()
        print(json.dumps(admitted), flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize(
    ("backend", "attempts"),
    [
        pytest.param("redis", 300, marks=pytest.mark.redis),
        pytest.param("postgres", 150, marks=pytest.mark.postgres),
    ],
)
def test_two_processes_share_one_limit(backend, attempts, ns, request) -> None:
    """Two OS processes hammering one organisation admit the limit once, not twice.

    Both hold the same frozen time per phase, ten seconds apart. The first
    phase spends the burst (100) and each later one the ten seconds' worth, so
    120 in all however the processes interleave: the last phase fills the
    schedule to exactly now + burst. The burst is large so that both processes
    are admitting at the same moment; a limiter that read and wrote separately
    would let both spend the same slot.
    """
    if backend == "postgres":
        request.getfixturevalue("pg_engine")
    code = WORKER % {
        "redis": REDIS_URL,
        "postgres": POSTGRES_URL,
        "schema": SCHEMA,
        "attempts": attempts,
    }
    start = ManualClock().now().isoformat()
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", code, backend, ns, start],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        for worker in workers:
            assert worker.stdout.readline().strip() == "ready"
        for worker in workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        counts = [json.loads(worker.communicate(timeout=HANG_S)[0]) for worker in workers]
        assert all(worker.returncode == 0 for worker in workers)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        cleanup(backend, ns)
    assert sum(counts) == 120


def cleanup(backend: str, ns: str) -> None:
    if backend == "redis":
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"batchyard-test:{ns}*"))
        if keys:
            client.delete(*keys)
        client.close()
    else:
        engine = postgres_engine()
        with engine.begin() as conn:
            conn.execute(sa.delete(rate_limits).where(rate_limits.c.key.startswith(ns)))
        engine.dispose()


# -- places in line -----------------------------------------------------------


async def test_each_refused_request_is_given_its_own_place_in_line(limiter, clock, ns) -> None:
    """Issue 22: refused callers of one burst are told successive times, not one time."""
    key = f"{ns}org:line"
    rpm = Limit("rpm", per_minute=20)  # one every 3 s
    assert (await limiter.try_acquire(key, [(rpm, 1)], hold_s=5)).allowed
    refused = [await limiter.try_acquire(key, [(rpm, 1)], hold_s=5) for _ in range(3)]
    assert [a.allowed for a in refused] == [False] * 3
    assert [a.retry_after for a in refused] == pytest.approx([3.0, 6.0, 9.0])
    assert {a.limit for a in refused} == {"rpm"}
    # The first comes back at its time and takes its place: admitted, nothing more spent.
    clock.advance(3.0)
    assert await limiter.try_acquire(key, [(rpm, 1)], hold_s=5) == Admission(True, 0.0)
    # A newcomer now finds no place due and is given one after the three already given.
    newcomer = await limiter.try_acquire(key, [(rpm, 1)], hold_s=5)
    assert newcomer == Admission(False, pytest.approx(9.0), "rpm")
    for _ in range(3):
        clock.advance(3.0)
        assert (await limiter.try_acquire(key, [(rpm, 1)], hold_s=5)).allowed
    # Every place is taken: the schedule is where five admissions put it, no further.
    assert await limiter.try_acquire(key, [(rpm, 1)], hold_s=5) == Admission(
        False, pytest.approx(3.0), "rpm"
    )


async def test_a_caller_back_a_little_early_still_takes_its_place(limiter, clock, ns) -> None:
    """Retry-After leaves a second of the queue unused: a replica whose clock runs ahead by
    less than that still finds the place due."""
    key = f"{ns}org:lines"
    rpm = Limit("rpm", per_minute=20)
    assert (await limiter.try_acquire(key, [(rpm, 1)], max_delay=2, hold_s=5)).allowed
    told = await limiter.try_acquire(key, [(rpm, 1)], max_delay=2, hold_s=5)
    assert told.retry_after == pytest.approx(3 - 2 + PLACE_SLACK_S)  # the place is at 3 s
    clock.advance(told.retry_after - PLACE_SLACK_S / 2)
    early = await limiter.try_acquire(key, [(rpm, 1)], max_delay=2, hold_s=5)
    assert early.allowed and early.delay == pytest.approx(2 - PLACE_SLACK_S / 2)


async def test_a_place_in_line_comes_back_within_the_queue_and_waits_there(
    limiter, clock, ns
) -> None:
    """Retry-After is the place less the server's queue: the retry waits the rest on the server."""
    key = f"{ns}org:lineq"
    limits = [(RPM, 1)]
    delays = [(await limiter.try_acquire(key, limits, max_delay=2, hold_s=5)) for _ in range(3)]
    assert [a.delay for a in delays] == pytest.approx([0, 1, 2])
    refused = [await limiter.try_acquire(key, limits, max_delay=2, hold_s=5) for _ in range(2)]
    # Places at 3 s and 4 s; each is told to come back a second (PLACE_SLACK_S) inside the queue.
    assert [a.retry_after for a in refused] == pytest.approx([2.0, 3.0])
    clock.advance(2.0)
    back = await limiter.try_acquire(key, limits, max_delay=2, hold_s=5)
    assert back.allowed and back.delay == pytest.approx(1.0)
    clock.advance(1.0)
    back = await limiter.try_acquire(key, limits, max_delay=2, hold_s=5)
    assert back.allowed and back.delay == pytest.approx(1.0)


async def test_an_unclaimed_place_expires_and_a_costlier_request_cannot_take_it(
    limiter, clock, ns
) -> None:
    key = f"{ns}org:linex"
    assert (await limiter.try_acquire(key, [(RPM, 1), (TPM, 10)], hold_s=5)).allowed
    given = await limiter.try_acquire(key, [(RPM, 1), (TPM, 10)], hold_s=5)
    assert given.retry_after == pytest.approx(1.0)
    clock.advance(1.0)
    # Not the same costs: not its place (the schedule already holds it, so it waits after).
    other = await limiter.try_acquire(key, [(RPM, 1), (TPM, 500)], hold_s=5)
    assert not other.allowed
    clock.advance(10.0)
    # Held five seconds past its time, then gone: its owner is now a newcomer.
    late = await limiter.try_acquire(key, [(RPM, 1), (TPM, 10)], hold_s=5)
    assert late.allowed


async def test_a_refusal_past_the_horizon_takes_no_place(limiter, clock, ns) -> None:
    key = f"{ns}org:lineh"
    slow = Limit("rpm", per_minute=1)  # one a minute: the second waits 60 s
    assert (await limiter.try_acquire(key, [(slow, 1)], hold_s=5)).allowed
    second = await limiter.try_acquire(key, [(slow, 1)], hold_s=5)
    assert second.retry_after == pytest.approx(60.0)  # within 60 s + no queue: a place
    third = await limiter.try_acquire(key, [(slow, 1)], hold_s=5)
    assert third == Admission(False, pytest.approx(120.0), "rpm")  # past it: none, honest wait
    fourth = await limiter.try_acquire(key, [(slow, 1)], hold_s=5)
    assert fourth.retry_after == pytest.approx(120.0)  # the third took nothing


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
async def test_a_place_given_by_one_replica_is_honoured_by_another(
    backend, clock, ns, request
) -> None:
    """Two limiters over one store (two replicas): the line is one line."""
    if backend == "redis":
        prefix = f"batchyard-test:{ns}"
        a, b = (
            RedisLimiter(REDIS_URL, clock, prefix=prefix),
            RedisLimiter(REDIS_URL, clock, prefix=prefix),
        )
    else:
        engine = request.getfixturevalue("pg_engine")
        a, b = SqlLimiter(engine, clock), SqlLimiter(engine, clock)
    key = f"{ns}org:replicas"
    try:
        assert (await a.try_acquire(key, [(RPM, 1)], hold_s=5)).allowed
        first = await a.try_acquire(key, [(RPM, 1)], hold_s=5)
        second = await b.try_acquire(key, [(RPM, 1)], hold_s=5)
        assert (first.retry_after, second.retry_after) == pytest.approx((1.0, 2.0))
        clock.advance(1.0)
        assert (await b.try_acquire(key, [(RPM, 1)], hold_s=5)).allowed
        clock.advance(1.0)
        assert (await a.try_acquire(key, [(RPM, 1)], hold_s=5)).allowed
    finally:
        await a.close()
        await b.close()
        cleanup(backend, ns)
