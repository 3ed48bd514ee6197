"""The reference: each item's optimal-stopping problem, solved on the family's own law.

A deferred item may be dispatched at any check from its submission to its
deadline where a route qualifies at its minimum; it should pay as little as
it can, and a missed deadline costs ``PENALTY`` times the direct price. With
the law known, that is an optimal-stopping problem in the market's state, and
``Reference`` solves it by least-squares Monte Carlo (Longstaff and Schwartz,
2001), at every 15-second check, with no pooling of checks:

1. From the market's *present* state (each route's regime level, slow
   wanders, auction price, whether a dip or an outage is on and how deep the
   dip is), it draws ``paths`` continuations of every route from the law,
   check by check, to the furthest deadline waiting (``simulate``).
2. Backward from each item's last check, on every path: at each check where
   the item qualifies, it stops if the price there is at most what going on is
   worth, the latter regressed on the state at that check (the item's best
   qualifying price and the market's noise-free best price, a quadratic in
   both); where nothing qualifies it goes on; past its last check it pays the
   penalty.
3. At the check it was solved at, an item is dispatched if its price now is at
   most the mean over paths of what the optimal plan from the next check pays.
   At the checks after, until the next solve, it waits while its price is
   above the regression of that check on the state seen there; where the
   regression says stop (or the price is below any the paths reached there),
   it re-solves from the present and decides on that (at most once a minute).

It re-solves every ``resolve`` checks and whenever a new (minimum, deadline)
pair arrives. Values are shares of the direct price of a request whose input
and output weigh alike (the routes' small skew between input and output
rates moves an item's price by at most a few percent; qualification uses the
exact guaranteed discount).

It runs inside the worker's replay (``bench/market/sim.py``): at most ten
dispatches a pass, items asked in deadline order, the rest carried. It knows
the law and the past, never a future draw: it reads the market only through
``Present``, which raises ``LookAhead`` on any check after the one the replay
has shown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import numpy as np
import numpy.typing as npt
from bench.market.laws import Family, RouteLaw
from bench.market.sim import DIRECT
from bench.market.trace import HIGHEST, LOWEST, PER_HOUR, RouteTrace, Trace, check_at, cycle

from batchyard.core.market import Item, RouteOffer, _cheapest, qualifies

__all__ = ["PENALTY", "LookAhead", "Present", "Reference"]

Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]

#: A missed deadline costs three times the direct price (what the policies assume too).
PENALTY = 3.0


class LookAhead(AssertionError):
    """The reference tried to read a check the replay had not shown yet."""


@dataclass(frozen=True)
class RouteState:
    """One route's parts at one check: what the law's future starts from."""

    law: RouteLaw
    regime: float
    wander: float
    step: float
    dip: float  # log factor, 0 outside a dip
    dark: bool
    fallback: RouteState | None


@dataclass(frozen=True)
class MarketState:
    check: int
    common: float
    feed_dark: bool
    routes: tuple[RouteState, ...]


class Present:
    """The trace as an online policy may read it: any check up to now, none after.

    ``advance`` is the replay's clock (it only moves forward); ``state`` raises
    ``LookAhead`` for a later check. The trace itself is kept private.
    """

    def __init__(self, trace: Trace) -> None:
        self.__trace = trace
        self.family: Family = trace.family
        self.now = -1
        self.latest_read = -1

    def advance(self, check: int) -> None:
        self.now = max(self.now, check)

    def state(self, check: int) -> MarketState:
        if check > self.now:
            raise LookAhead(f"read check {check} at check {self.now}")
        self.latest_read = max(self.latest_read, check)
        t = self.__trace
        return MarketState(
            check,
            float(t.common[check]),
            bool(t.feed_dark[check]),
            tuple(_route_state(r, check) for r in t.routes),
        )


def _route_state(route: RouteTrace, k: int) -> RouteState:
    return RouteState(
        route.law,
        float(route.regime[k]),
        float(route.wander[k]),
        float(route.step[k]),
        float(route.dip[k]),
        bool(route.dark[k]),
        None if route.fallback is None else _route_state(route.fallback, k),
    )


def _phi(half_life_h: float) -> float:
    return 0.5 ** (1 / max(1.0, half_life_h * PER_HOUR))


def _ar1(
    rng: np.random.Generator, start: float, sd: float, half_life_h: float, shape: tuple[int, int]
) -> Floats:
    """AR(1) paths from ``start`` (stationary spread ``sd``), in blocks of scaled cumsums."""
    m, h = shape
    if sd <= 0:
        return np.full(shape, start) * _phi(half_life_h) ** np.arange(1, h + 1)[None, :]
    phi = _phi(half_life_h)
    shocks = rng.normal(0, sd * math.sqrt(1 - phi * phi), size=shape)
    out = np.empty(shape)
    level = np.full(m, start)
    block = 120  # phi ** -120 stays small for every half-life the laws use
    for lo in range(0, h, block):
        hi = min(h, lo + block)
        j = np.arange(1, hi - lo + 1)
        up = phi ** (-j)
        out[:, lo:hi] = phi**j * (level[:, None] + np.cumsum(shocks[:, lo:hi] * up, axis=1))
        level = out[:, hi - 1]
    return out


def _episodes(
    rng: np.random.Generator, on_now: bool, every: float, mean_len: float, shape: tuple[int, int]
) -> tuple[Bools, npt.NDArray[np.int64]]:
    """Memoryless on/off episodes from the present: (on, episode index; 0 = the one on now)."""
    m, h = shape
    if every <= 0 and not on_now:
        return np.zeros(shape, bool), np.full(shape, -1, np.int64)
    k = int(3 * h / (every + mean_len)) + 8 if every > 0 else 1
    lens = rng.geometric(1 / max(1.0, mean_len), size=(m, k))
    waits = rng.geometric(1 / every, size=(m, k)) if every > 0 else np.full((m, k), 10 * h)
    if on_now:
        waits[:, 0] = 0
    else:
        waits[:, 0] -= 1  # the wait already includes this check
    starts = np.cumsum(waits + lens, axis=1) - lens
    ends = starts + lens
    rows = np.repeat(np.arange(m), k)
    diff = np.zeros((m, h + 1), np.int64)
    np.add.at(diff, (rows, np.minimum(starts, h).ravel()), 1)
    begun = np.cumsum(diff, axis=1)[:, :h]
    np.add.at(diff, (rows, np.minimum(ends, h).ravel()), -1)
    on = np.cumsum(diff, axis=1)[:, :h] > 0
    index = begun - 1 if on_now else begun
    return on, np.where(on, index, -1)


def _noise(rng: np.random.Generator, law: RouteLaw, shape: tuple[int, int]) -> Floats:
    if law.noise <= 0:
        return np.zeros(shape)
    if law.noise_df > 2:
        scale = law.noise * math.sqrt((law.noise_df - 2) / law.noise_df)
        return np.asarray(rng.standard_t(law.noise_df, size=shape)) * scale
    return rng.normal(0, law.noise, size=shape)


def _payable(law: RouteLaw | None) -> bool:
    return law is None or (law.caps and _payable(law.fallback))


def simulate(
    fam: Family, state: MarketState, horizon: int, paths: int, rng: np.random.Generator
) -> tuple[list[tuple[Floats, Floats, float]], Floats]:
    """The law's continuations from ``state`` over the next ``horizon`` checks.

    Returns, per payable route, (price share [path, check], nan where dark; the
    share with no noise nor dip; the route's worst skew) and the noise-free
    best share over the live routes [path, check].
    """
    shape = (paths, horizon)
    t = state.check
    checks = np.arange(t + 1, t + 1 + horizon, dtype=np.float64)
    common = _ar1(rng, state.common, fam.common, fam.common_half_life_h, shape)
    feed, _ = _episodes(
        rng, state.feed_dark, fam.feed_gap_every_h * PER_HOUR, fam.feed_gap_minutes * 4, shape
    )
    out: list[tuple[Floats, Floats, float]] = []
    calm_best = np.full(shape, math.inf)
    for route in state.routes:
        if not _payable(route.law):
            continue
        level, calm, dark = _route(rng, route, checks, common, shape)
        skew = 1 + abs(route.law.skew)
        r: RouteState | None = route.fallback
        while r is not None:  # any fallback may serve: the dearer, and dark if either is
            fb_level, fb_calm, fb_dark = _route(rng, r, checks, common, shape)
            level, calm = np.maximum(level, fb_level), np.maximum(calm, fb_calm)
            dark = dark | fb_dark
            skew = max(skew, 1 + abs(r.law.skew))
            r = r.fallback
        dark |= feed
        out.append((np.where(dark, np.nan, level), calm, skew))
        np.minimum(calm_best, np.where(dark, math.inf, calm), out=calm_best)
    return out, np.where(np.isfinite(calm_best), calm_best, HIGHEST)


def _route(
    rng: np.random.Generator, route: RouteState, checks: Floats, common: Floats,
    shape: tuple[int, int],
) -> tuple[Floats, Floats, Bools]:  # fmt: skip
    law = route.law
    m, h = shape
    log = cycle(law, checks)[None, :] + common
    log = log + _ar1(rng, route.wander, law.wander, law.wander_half_life_h, shape)
    if law.regime_every_h > 0:
        times = np.cumsum(rng.geometric(1 / (law.regime_every_h * PER_HOUR), size=(m, 64)), axis=1)
        count = np.zeros((m, h + 1), np.int64)
        np.add.at(count, (np.repeat(np.arange(m), 64), np.minimum(times - 1, h).ravel()), 1)
        jumps = np.cumsum(count, axis=1)[:, :h]
        lo, hi = (math.log(x) for x in law.regime_range)
        levels = math.log(law.base) + rng.uniform(lo, hi, size=(m, 65))
        levels[:, 0] = route.regime
        log = log + np.take_along_axis(levels, jumps, axis=1)
    else:
        log = log + route.regime
    if law.step_minutes:
        size = law.step_minutes * 4
        t = int(checks[0]) - 1
        ahead = (checks.astype(np.int64) // size - t // size)[None, :]
        drawn = rng.normal(0, law.step, size=(m, int(ahead.max()) + 1))
        drawn[:, 0] = route.step
        log = log + np.take_along_axis(drawn, np.broadcast_to(ahead, shape), axis=1)
    calm = np.clip(np.exp(log), LOWEST, HIGHEST)
    log = log + _noise(rng, law, shape)
    on, which = _episodes(
        rng, route.dip < 0, law.dip_every_h * PER_HOUR, law.dip_minutes * 4, shape
    )
    if on.any():
        lo, hi = (math.log(x) for x in law.dip_factor)
        factors = rng.uniform(lo, hi, size=(m, int(which.max()) + 2))
        factors[:, 0] = route.dip if route.dip < 0 else factors[:, 0]
        log = log + np.where(on, np.take_along_axis(factors, np.maximum(which, 0), axis=1), 0.0)
    dark, _ = _episodes(rng, route.dark, law.gap_every_h * PER_HOUR, law.gap_minutes * 4, shape)
    return np.clip(np.exp(log), LOWEST, HIGHEST), calm, dark


def _basis(x: Floats, y: Floats) -> Floats:
    """Regressors of the continuation: a quadratic in the price here and the calm price."""
    return np.stack([np.ones_like(x), x, y, x * x, y * y, x * y], axis=-1)


@dataclass
class _Solved:
    """One solve: its check, the continuation at it, and each later check's regression."""

    at: int
    until: int
    value: dict[tuple[float, int], float]
    coef: dict[tuple[float, int], Floats]  # [check after ``at``, basis]
    lowest: dict[float, Floats]  # per minimum: the lowest qualifying price the paths reached


class Reference:
    """Least-squares Monte Carlo on the true law, per item; see the module docstring."""

    name = "reference"

    def __init__(
        self,
        present: Present,
        *,
        paths: int = 128,
        resolve: int = 240,
        confirm: int = 4,
        penalty: float = PENALTY,
        seed: int = 0,
    ) -> None:
        self.present = present
        self.paths = paths
        self.resolve = resolve
        self.confirm = confirm
        self.penalty = penalty
        self.rng = np.random.default_rng(seed + 11)
        self.solved: _Solved | None = None
        self.pending: dict[tuple[float, int], int] = {}  # (minimum, last check) -> last asked
        self._x: dict[tuple[int, float], tuple[float, float]] = {}
        self.solves = 0

    def observe(self, offers: Sequence[RouteOffer], direct: object, now: datetime) -> None:
        self.present.advance(check_at(now))

    def choose(
        self, item: Item, offers: Sequence[RouteOffer], direct: object, now: datetime
    ) -> RouteOffer | None:
        t = check_at(now)
        self.present.advance(t)
        if now >= item.deadline:
            return None
        best = _cheapest(item, offers, DIRECT, item.min_discount)
        if best is None:
            return None
        last = math.ceil((item.deadline - now).total_seconds() / 15) - 1 + t
        if last <= t:
            return best
        key = (float(item.min_discount), last)
        self.pending[key] = t
        solved = self.solved
        if solved is None or key not in solved.value or t - solved.at >= self.resolve:
            solved = self._solve(t)
        x, y = self._now(t, offers, item.min_discount)
        if t != solved.at:
            coef = solved.coef[key][t - solved.at - 1]
            going_on = float(_basis(np.array(x), np.array(y)) @ coef)
            low = solved.lowest[key[0]][t - solved.at - 1]
            # A stop is final: confirm it from the present itself, as is any price below
            # what the solve's paths reached (the regression would extrapolate there).
            if (x <= going_on or x < low) and t - solved.at >= self.confirm:
                solved = self._solve(t)
        if t == solved.at:
            going_on = solved.value[key]
        return best if x <= going_on else None

    def _now(self, t: int, offers: Sequence[RouteOffer], minimum: Decimal) -> tuple[float, float]:
        """(best qualifying share, calm best share) now, as the solve's regressors read them."""
        got = self._x.get((t, minimum))
        if got is None:
            if len(self._x) > 64:
                self._x.clear()
            x = min((_share(o) for o in offers if qualifies(o, DIRECT, minimum)), default=math.inf)
            got = self._x[(t, minimum)] = (x, _calm(self.present.state(t)))
        return got

    def _solve(self, t: int) -> _Solved:
        self.solves += 1
        keys = sorted(k for k, asked in self.pending.items() if k[1] > t and t - asked < 8)
        self.pending = {k: self.pending[k] for k in keys}
        horizon = max(k[1] for k in keys) - t
        routes, calm = simulate(
            self.present.family, self.present.state(t), horizon, self.paths, self.rng
        )
        value: dict[tuple[float, int], float] = {}
        coef: dict[tuple[float, int], Floats] = {}
        lowest: dict[float, Floats] = {}
        keep = min(self.resolve, horizon)
        for minimum in sorted({k[0] for k in keys}):
            mine = [k for k in keys if k[0] == minimum]
            lasts = np.array([k[1] - t - 1 for k in mine])  # last check, as a column index
            x = _best(routes, minimum)  # [path, check]
            lowest[minimum] = x[:, :keep].min(axis=0)
            v, c = _lsmc(x, calm, lasts, self.penalty, keep)
            for i, k in enumerate(mine):
                value[k] = float(v[i])
                coef[k] = c[i]
        self.solved = _Solved(t, t + keep, value, coef, lowest)
        return self.solved


def _share(offer: RouteOffer) -> float:
    """An offer's price as a share of the direct price, input and output weighed alike."""
    assert offer.price is not None
    own = float(offer.price.input_per_mtok + offer.price.output_per_mtok / 4) / 2
    return max([own, *(_share(fb) for fb in offer.fallbacks)])


def _calm(state: MarketState) -> float:
    """The noise-free, dip-free best share over the routes live now."""
    best = math.inf
    for route in state.routes:
        if not _payable(route.law) or state.feed_dark:
            continue
        share, r, dark = 0.0, route, False
        while r is not None:
            log = r.regime + float(cycle(r.law, np.array([float(state.check)]))[0])
            log += r.wander + state.common + r.step
            share = max(share, min(max(math.exp(log), LOWEST), HIGHEST))
            dark |= r.dark
            r = r.fallback
        if not dark:
            best = min(best, share)
    return best if math.isfinite(best) else HIGHEST


def _best(routes: list[tuple[Floats, Floats, float]], minimum: float) -> Floats:
    """The cheapest share that qualifies at ``minimum`` per path and check (inf: none)."""
    limit = 1 - minimum / 100
    best: Floats | None = None
    for level, _, skew in routes:
        ok = level * skew <= limit + 1e-12  # nan (dark) compares False
        here = np.where(ok, level, math.inf)
        best = here if best is None else np.minimum(best, here)
    assert best is not None
    return best


def _lsmc(
    x: Floats, y: Floats, lasts: npt.NDArray[np.int64], penalty: float, keep: int
) -> tuple[Floats, Floats]:
    """Longstaff-Schwartz for items sharing a minimum: ``x[path, check]`` their price.

    Returns the continuation value at the solve (per item) and each item's
    regression coefficients at the first ``keep`` checks after it.
    """
    n_items = len(lasts)
    paid = np.full((x.shape[0], n_items), penalty)
    coef = np.zeros((n_items, keep, 6))
    coef[:, :, 0] = penalty
    qual = np.isfinite(x)
    counts = qual.sum(axis=0)
    xs = np.where(qual, x, 0.0)
    # Every check's regressors and normal equations at once; the loop only applies them.
    basis = _basis(xs.T, y.T)  # [check, path, 6]
    fit = basis * qual.T[:, :, None]
    fit_t = fit.transpose(0, 2, 1)
    gram = fit_t @ fit
    gram += (1e-6 * np.trace(gram, axis1=1, axis2=2) + 1e-12)[:, None, None] * np.eye(6)
    enough = counts >= 12
    inv = np.linalg.inv(gram)
    solver = inv @ fit_t  # [check, 6, path]: beta = solver @ paid
    top = int(lasts.max())
    for k in range(top, -1, -1):
        if not counts[k] and k >= keep:
            continue
        live = lasts >= k
        if not counts[k]:
            # Nothing can stop here on any path: the continuation is the plain mean.
            coef[:, k, 0] = np.where(live, paid.mean(axis=0), penalty)
            continue
        if enough[k]:
            beta = solver[k] @ paid  # [6, item]
        else:  # too few paths to regress on: the plain mean of going on
            beta = np.zeros((6, n_items))
            beta[0] = paid.mean(axis=0)
        if k < keep:
            coef[:, k] = np.where(live[:, None], beta.T, coef[:, k])
        fitted = basis[k] @ beta  # [path, item]
        stop = x[:, k, None] <= fitted
        stop &= qual[:, k, None]
        stop &= live[None, :]
        np.copyto(paid, xs[:, k, None], where=stop)
    return paid.mean(axis=0), coef
