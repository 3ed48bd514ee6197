"""Price traces drawn from a family's law, and that law's own scenarios of the future.

``Trace`` draws every part of every route at every 15-second check and keeps
them, so that at any check the *state* of the market is known: the regime
level, the slow wanders, the current auction price, whether a dip or an
outage is on. ``TrueLaw`` is a ``ScenarioSource`` that, handed that state,
draws the futures the law itself would produce, pooled in the policy's
columns: handed to ``DeadlineAware`` it shows what knowing the law is worth
to that policy (the reference, ``bench/market/reference.py``, draws its own
futures check by check).

The futures are drawn at the resolution of the stopping columns
(``batchyard.core.stopping``): the per-check parts (noise, dips, outages) are
drawn check by check into banks once per trace and pooled per column; the
slow parts are taken at each column's middle. Each bank is reused, in turn,
for the decisions of a trace (common random numbers), which is fine for a
yardstick and keeps it fast.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
import numpy.typing as npt
from bench.market.laws import Family, RouteLaw

from batchyard.core.stopping import COLUMNS, Columns

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

CHECK_S = 15
PER_HOUR = 3600 // CHECK_S
PER_DAY = 24 * PER_HOUR
START = datetime(2026, 3, 2, tzinfo=UTC)
LOWEST, HIGHEST = 0.002, 3.0


def check_at(now: datetime) -> int:
    return int((now - START).total_seconds() // CHECK_S)


def time_of(check: int | float) -> datetime:
    return START + timedelta(seconds=float(check) * CHECK_S)


def _half_life(hours: float) -> float:
    return 0.5 ** (1 / max(1.0, hours * PER_HOUR))


def _log_uniform(rng: np.random.Generator, lo_hi: tuple[float, float], size: object) -> Floats:
    lo, hi = lo_hi
    return np.asarray(rng.uniform(math.log(lo), math.log(hi), size=size))  # type: ignore[call-overload]


def episodes(
    rng: np.random.Generator, paths: int, length: int, every: float, mean_len: float
) -> tuple[Bools, Ints]:
    """On/off episodes: waits and lengths geometric (memoryless), in checks.

    Returns (on[path, check], index of the episode covering each check or -1).
    """
    if every <= 0:
        return np.zeros((paths, length), bool), np.full((paths, length), -1, np.int64)
    k = int(3 * length / (every + mean_len)) + 20
    waits = rng.geometric(1 / every, size=(paths, k))
    lens = rng.geometric(1 / max(1.0, mean_len), size=(paths, k))
    starts = np.cumsum(waits + lens, axis=1) - lens
    ends = starts + lens
    rows = np.repeat(np.arange(paths), k)
    diff = np.zeros((paths, length + 1), np.int64)
    np.add.at(diff, (rows, np.minimum(starts, length).ravel()), 1)
    begun = np.cumsum(diff, axis=1)[:, :length]
    np.add.at(diff, (rows, np.minimum(ends, length).ravel()), -1)
    on = np.cumsum(diff, axis=1)[:, :length] > 0
    return on, np.where(on, begun - 1, -1)


def jumps(rng: np.random.Generator, paths: int, length: int, every: float) -> Ints:
    """How many jumps have happened by each check (memoryless waits), minus one."""
    if every <= 0:
        return np.full((paths, length), -1, np.int64)
    k = int(3 * length / every) + 20
    times = np.cumsum(rng.geometric(1 / every, size=(paths, k)), axis=1)
    count = np.zeros((paths, length + 1), np.int64)
    rows = np.repeat(np.arange(paths), k)
    np.add.at(count, (rows, np.minimum(times, length).ravel()), 1)
    return np.cumsum(count, axis=1)[:, :length] - 1


def wander(rng: np.random.Generator, paths: int, length: int, sd: float, half_life_h: float,
           start: Floats | None = None) -> Floats:  # fmt: skip
    """AR(1) log-price wander with stationary spread ``sd``, from ``start`` (default 0)."""
    out = np.zeros((paths, length))
    if sd <= 0:
        return out
    phi = _half_life(half_life_h)
    shocks = rng.normal(0, sd * math.sqrt(1 - phi * phi), size=(paths, length))
    level = np.zeros(paths) if start is None else start.copy()
    for k in range(length):
        level = phi * level + shocks[:, k]
        out[:, k] = level
    return out


def noise(rng: np.random.Generator, law: RouteLaw, paths: int, length: int) -> Floats:
    if law.noise <= 0:
        return np.zeros((paths, length))
    if law.noise_df > 2:
        scale = law.noise * math.sqrt((law.noise_df - 2) / law.noise_df)
        return np.asarray(rng.standard_t(law.noise_df, size=(paths, length))) * scale
    return rng.normal(0, law.noise, size=(paths, length))


def cycle(law: RouteLaw, checks: Floats) -> Floats:
    hours = checks / PER_HOUR
    return law.cycle * np.cos(2 * math.pi * (hours - law.phase_h) / 24)


@dataclass
class RouteTrace:
    law: RouteLaw
    regime: Floats  # log level
    wander: Floats
    step: Floats
    noise: Floats
    dip: Floats  # log factor, 0 outside dips
    dark: Bools  # this route's own feed outage
    fallback: RouteTrace | None = None


class Trace:
    """Every part of every route of one market, at every check of ``days`` days."""

    def __init__(self, fam: Family, seed: int, days: int) -> None:
        self.family = fam
        self.n = days * PER_DAY
        rng = np.random.default_rng(zlib.crc32(f"{fam.name}/{seed}".encode()))
        n = self.n
        self.common = wander(rng, 1, n, fam.common, fam.common_half_life_h)[0]
        self.feed_dark = episodes(
            rng, 1, n, fam.feed_gap_every_h * PER_HOUR, fam.feed_gap_minutes * 4
        )[0][0]
        self.routes = [self._route(rng, law) for law in fam.routes]

    def _route(self, rng: np.random.Generator, law: RouteLaw) -> RouteTrace:
        n = self.n
        idx = jumps(rng, 1, n, law.regime_every_h * PER_HOUR)[0]
        levels = _log_uniform(rng, law.regime_range, idx.max() + 2)
        regime = math.log(law.base) + np.where(idx < 0, 0.0, levels[np.maximum(idx, 0)])
        steps = np.zeros(n)
        if law.step_minutes:
            size = law.step_minutes * 4
            steps = rng.normal(0, law.step, size=n // size + 1)[np.arange(n) // size]
        on, which = episodes(rng, 1, n, law.dip_every_h * PER_HOUR, law.dip_minutes * 4)
        factors = _log_uniform(rng, law.dip_factor, which.max() + 2)
        dip = np.where(on[0], factors[np.maximum(which[0], 0)], 0.0)
        dark = episodes(rng, 1, n, law.gap_every_h * PER_HOUR, law.gap_minutes * 4)[0][0]
        start = rng.normal(0, law.wander, size=1) if law.wander else None
        return RouteTrace(
            law=law,
            regime=regime,
            wander=wander(rng, 1, n, law.wander, law.wander_half_life_h, start)[0],
            step=steps,
            noise=noise(rng, law, 1, n)[0],
            dip=dip,
            dark=dark,
            fallback=None if law.fallback is None else self._route(rng, law.fallback),
        )

    def level(self, route: RouteTrace) -> Floats:
        """The route's price as a share of the direct price at every check (nan: dark)."""
        checks = np.arange(self.n, dtype=np.float64)
        log = (
            route.regime + cycle(route.law, checks) + route.wander + self.common
            + route.step + route.noise + route.dip
        )  # fmt: skip
        price = np.clip(np.exp(log), LOWEST, HIGHEST)
        return np.where(route.dark | self.feed_dark, np.nan, price)


@dataclass
class _Bank:
    """Futures of the parts that do not depend on the present, drawn once, pooled per column.

    The wanders' own innovations (a wander started from zero) are drawn check
    by check with the noise, so that a wide column holds the deepest price of
    a wander that moves inside it; the present's share of the wander, which
    only decays, is added at the column's middle.
    """

    best: dict[str, Floats]  # deepest (wanders + noise + future dips) per column, among live checks
    calm: dict[str, Floats]  # the same without dips (for a dip that is on now)
    regime: dict[str, Ints]  # jumps by each column's start and end
    regime_end: dict[str, Ints]
    levels: dict[str, Floats]
    steps: dict[str, Floats]
    dip_left: dict[str, Ints]
    dark_left: dict[str, Ints]
    feed_left: Ints


class TrueLaw:
    """The family's law, from the trace's present state, as the policy's scenarios."""

    def __init__(
        self, trace: Trace, *, paths: int = 128, banks: int = 3, seed: int = 0,
        columns: Columns = COLUMNS,
    ) -> None:  # fmt: skip
        self.trace = trace
        self.columns = columns
        self.paths = paths
        self.mids = columns.offsets + (columns.widths - 1) / 2
        self.cover = int(columns.ends[-1])
        rng = np.random.default_rng(seed + 7)
        self._laws = _all_routes(trace)
        self._banks = [self._bank(rng) for _ in range(banks)]
        self._calls = 0

    def _pool(self, values: Floats) -> Floats:
        """min over each column's checks (the deepest price), inf where none is live."""
        out = np.empty((values.shape[0], len(self.columns.widths)))
        for width in np.unique(self.columns.widths):
            which = np.flatnonzero(self.columns.widths == width)
            w = int(width)
            lo, hi = int(self.columns.offsets[which[0]]), int(self.columns.ends[which[-1]])
            out[:, which] = values[:, lo:hi].reshape(values.shape[0], -1, w).min(axis=2)
        return out

    def _bank(self, rng: np.random.Generator) -> _Bank:
        m, h = self.paths, self.cover
        starts, ends = self.columns.offsets, self.columns.ends - 1
        fam = self.trace.family
        feed_len = fam.feed_gap_minutes * 4
        feed_dark = episodes(rng, m, h, fam.feed_gap_every_h * PER_HOUR, feed_len)[0]
        feed_left = rng.geometric(1 / max(1.0, feed_len), size=m)
        bank = _Bank({}, {}, {}, {}, {}, {}, {}, {}, feed_left=feed_left)
        common = wander(rng, m, h, fam.common, fam.common_half_life_h)
        for name, law in self._laws.items():
            calm = noise(rng, law, m, h) + common
            calm += wander(rng, m, h, law.wander, law.wander_half_life_h)
            on, which = episodes(rng, m, h, law.dip_every_h * PER_HOUR, law.dip_minutes * 4)
            factors = _log_uniform(rng, law.dip_factor, (m, int(which.max()) + 2))
            dips = np.where(on, np.take_along_axis(factors, np.maximum(which, 0), axis=1), 0.0)
            dark = episodes(rng, m, h, law.gap_every_h * PER_HOUR, law.gap_minutes * 4)[0]
            dark |= feed_dark
            bank.best[name] = self._pool(np.where(dark, np.inf, calm + dips))
            bank.calm[name] = self._pool(np.where(dark, np.inf, calm))
            idx = jumps(rng, m, h, law.regime_every_h * PER_HOUR)
            bank.regime[name] = idx[:, starts]
            bank.regime_end[name] = idx[:, ends]
            bank.levels[name] = math.log(law.base) + _log_uniform(
                rng, law.regime_range, (m, int(idx.max()) + 2)
            )
            if law.step_minutes:
                bank.steps[name] = rng.normal(
                    0, law.step, size=(m, h // (law.step_minutes * 4) + 3)
                )
            bank.dip_left[name] = rng.geometric(1 / max(1.0, law.dip_minutes * 4), size=m)
            bank.dark_left[name] = rng.geometric(1 / max(1.0, law.gap_minutes * 4), size=m)
        return bank

    def scenarios(self, routes: Sequence[str], now: datetime) -> tuple[Floats, int] | None:
        t = check_at(now)
        bank = self._banks[self._calls % len(self._banks)]
        self._calls += 1
        out = np.full((self.paths, len(self.mids)), -math.inf)
        by_name = {r.law.name: r for r in self.trace.routes}
        fam = self.trace.family
        common = self._decay(self.trace.common[t], fam.common_half_life_h)
        for name in routes:
            route = by_name.get(name)
            if route is None:
                continue
            d = self._route(route, t, bank, common)
            if route.fallback is not None:
                d = np.minimum(d, self._route(route.fallback, t, bank, common))
            np.maximum(out, d, out=out)
        return out, self.cover

    def _decay(self, now: float, half_life_h: float) -> Floats:
        """What is left of a wander's present value at each column's middle."""
        return now * _half_life(half_life_h) ** (self.mids + 1)

    def _at_best(self, now: float, idx: Ints, end: Ints, levels: Floats) -> Floats:
        """A level that may jump: the lower of its values at a column's first and last check."""
        first = np.where(idx < 0, now, np.take_along_axis(levels, np.maximum(idx, 0), axis=1))
        last = np.where(end < 0, now, np.take_along_axis(levels, np.maximum(end, 0), axis=1))
        return np.minimum(first, last)

    def _route(self, route: RouteTrace, t: int, bank: _Bank, common: Floats) -> Floats:
        law, name = route.law, route.law.name
        if not law.caps:
            return np.full((self.paths, len(self.mids)), -math.inf)
        cols = self.columns
        log = (cycle(law, t + 1 + self.mids) + common)[None, :]
        log = log + self._decay(route.wander[t], law.wander_half_life_h)[None, :]
        log = log + self._at_best(
            route.regime[t], bank.regime[name], bank.regime_end[name], bank.levels[name]
        )
        if law.step_minutes:
            size = law.step_minutes * 4
            drawn = bank.steps[name]
            values = []
            for edge in (cols.offsets, cols.ends - 1):
                ahead = ((t + 1 + edge) // size - t // size).astype(np.int64)
                got = drawn[:, np.minimum(ahead, drawn.shape[1] - 1)]
                values.append(np.where(ahead[None, :] == 0, route.step[t], got))
            log = log + np.minimum(values[0], values[1])
        pooled = bank.best[name]
        if route.dip[t] < 0:  # a dip is on: it lasts a memoryless while yet
            lasting = cols.offsets[None, :] < bank.dip_left[name][:, None]
            pooled = np.where(lasting, np.minimum(pooled, bank.calm[name] + route.dip[t]), pooled)
        log = log + pooled
        dark = np.zeros_like(log, dtype=bool)
        if route.dark[t]:
            dark |= cols.ends[None, :] <= bank.dark_left[name][:, None]
        if self.trace.feed_dark[t]:
            dark |= cols.ends[None, :] <= bank.feed_left[:, None]
        price = np.clip(np.exp(log), LOWEST, HIGHEST) * (1 + abs(law.skew))
        return np.where(dark | ~np.isfinite(log), -math.inf, 100.0 * (1 - price))


def _all_routes(trace: Trace) -> dict[str, RouteLaw]:
    out: dict[str, RouteLaw] = {}
    for route in trace.routes:
        r: RouteTrace | None = route
        while r is not None:
            out[r.law.name] = r.law
            r = r.fallback
    return out
