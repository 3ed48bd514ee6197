"""The one clock: ManualClock moves only when told, and sleepers wake when it passes them."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest

from batchyard.core.clock import Clock, ManualClock, SystemClock, isoformat, parse_iso
from tests.support.waits import settles

# The runs API's pattern for createdAt/updatedAt (docs/reference/runs.md).
SEED_ISO = re.compile(
    r"^(?:(?:\d\d[2468][048]|\d\d[13579][26]|\d\d0[48]|[02468][048]00|[13579][26]00)-02-29|"
    r"\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|"
    r"(?:02)-(?:0[1-9]|1\d|2[0-8])))T(?:(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d+)?(?:Z))$"
)


def test_both_clocks_satisfy_the_protocol():
    assert isinstance(ManualClock(), Clock)
    assert isinstance(SystemClock(), Clock)
    now = SystemClock().now()
    assert now.tzinfo is not None and now.utcoffset() == timedelta(0)


def test_manual_clock_moves_only_when_told():
    clock = ManualClock()
    t0, n0 = clock.time(), clock.now()
    assert clock.now() == n0
    clock.advance(2.5)
    assert clock.time() == pytest.approx(t0 + 2.5)
    assert clock.now() - n0 == timedelta(seconds=2.5)
    clock.set(datetime(2030, 5, 1, tzinfo=UTC))
    assert clock.now().year == 2030
    with pytest.raises(ValueError):
        clock.set(datetime(2030, 5, 1))  # naive


async def test_sleepers_wake_when_time_passes_them_and_not_before():
    clock = ManualClock()
    woke: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [
        asyncio.create_task(sleeper("short", 5)),
        asyncio.create_task(sleeper("long", 60)),
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    assert woke == []
    clock.advance(4.9)
    for _ in range(5):
        await asyncio.sleep(0)
    assert woke == []
    clock.advance(0.1)
    for _ in range(5):
        await asyncio.sleep(0)
    assert woke == ["short"]
    clock.set(clock.now() + timedelta(minutes=5))
    await settles(asyncio.gather(*tasks))
    assert woke == ["short", "long"]


async def test_zero_and_negative_sleeps_return_at_once():
    clock = ManualClock()
    await settles(clock.sleep(0))
    await settles(clock.sleep(-3))


@pytest.mark.parametrize(
    ("when", "text"),
    [
        (datetime(2026, 1, 1, tzinfo=UTC), "2026-01-01T00:00:00.000Z"),
        (datetime(2024, 2, 29, 23, 59, 59, 999_999, tzinfo=UTC), "2024-02-29T23:59:59.999Z"),
        (
            datetime(2026, 7, 1, 2, 0, 0, 123_000, tzinfo=timezone(timedelta(hours=2))),
            "2026-07-01T00:00:00.123Z",
        ),
    ],
)
def test_isoformat_is_utc_with_z_and_matches_the_seed_pattern(when, text):
    assert isoformat(when) == text
    assert SEED_ISO.match(text)
    assert parse_iso(text) == when.replace(microsecond=when.microsecond // 1000 * 1000)


def test_isoformat_of_the_clock_matches_the_seed_pattern():
    clock = ManualClock()
    for _ in range(50):
        clock.advance(86_400 * 7.3 + 0.0371)
        assert SEED_ISO.match(isoformat(clock.now()))
    assert SEED_ISO.match(isoformat(SystemClock().now()))
