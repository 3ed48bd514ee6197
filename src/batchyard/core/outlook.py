"""What a market may offer next, read from each route's own past.

``DeadlineAware`` (``batchyard.core.market``) must decide, for an item that
could be dispatched now, whether a deeper discount is likely enough before its
deadline to be worth the wait. That needs *scenarios*: plausible futures of
every route the item could use, starting from where the market stands now.
They are built from each route's history, with as few assumptions as the data
allows:

* ``RouteHistory`` (``batchyard.core.route_history``) keeps each route's
  guaranteed discount at every 15-second slot.
* ``RouteFit`` splits a route's past, on the scale of ``-log(price)``
  (``depth``: prices move by multiples), into a daily cycle (up to three
  harmonics of 24 h, as many as predict a day left out, once the history
  spans a day and a half) and a residual, and measures how much of today's
  residual survives ``h`` checks later (``rho``: the regression of the
  residual then on a two-minute mean of the residual now). Nothing else is
  assumed: no distribution, no process, no period but the day.
* ``HistoryScenarios`` takes the past moments whose state (each route's
  residual level and its trend over the last half hour, and whether it was
  payable) was closest to now, and replays what each route did after them,
  shifted by the gap between then and now times ``rho`` (a gap that the
  residual's own memory says fades, fades), on top of the cycle at the
  future's own time of day. That is the method of analogues with the
  predictable part taken out first, so that a week of history holds many
  usable analogues instead of a handful at the same hour.

Discounts here are floats: they only rank and estimate, never authorise a
spend or count money (``qualifies`` does that, exactly, on fresh prices).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

import numpy as np
import numpy.typing as npt

from batchyard.core.route_history import SLOT, RouteHistory, slot_index
from batchyard.core.stopping import COLUMNS, Columns

__all__ = [
    "HistoryScenarios",
    "RouteFit",
    "ScenarioSource",
    "depth",
    "discount",
    "first_crossing",
    "fit_route",
]

Floats = npt.NDArray[np.float64]

_DAY_SLOTS = int(timedelta(days=1) / SLOT)
#: The state an analogue is matched on: a 2-minute mean, and its change over 30 minutes.
_MEAN_SLOTS = 8
_TREND_SLOTS = 120
_HARMONICS = 3
_ALIGN = int(COLUMNS.widths.max())


def depth(discounts: Floats) -> Floats:
    """Discounts (points) as ``-log(price / direct)``, the scale the model works in.

    Prices move by multiples, not by points: a cycle or a noise that moves a
    dear price by ten points moves a price at 90 % off by one. Unpayable
    (``-inf``) and unknown (``nan``) stay as they are.
    """
    share = np.maximum(1.0 - np.asarray(discounts) / 100.0, 1e-4)
    with np.errstate(invalid="ignore"):
        return np.where(np.isneginf(discounts), -math.inf, -np.log(share))


def discount(depths: Floats) -> Floats:
    """The inverse of ``depth``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isneginf(depths), -math.inf, -100.0 * np.expm1(-depths))


@dataclass(frozen=True, slots=True)
class RouteFit:
    """A route's daily cycle and the memory of its residual, fitted at slot ``at``."""

    at: int
    #: Coefficients of (sin, cos) for 1..3 cycles a day; zeros where no cycle is kept.
    harmonics: Floats
    #: ``rho(lag)`` on ``lags``: the share of a residual gap still there ``lag`` checks on.
    lags: Floats
    rho: Floats
    #: Spread of the 2-minute residual mean, which analogues are compared in.
    scale: float
    #: The cycle at each slot of the day.
    profile: Floats

    def cycle(self, slots: Floats) -> Floats:
        """The daily cycle at ``slots``, in points of discount."""
        return self.profile[(np.asarray(slots) % _DAY_SLOTS).astype(np.int64)]

    def memory(self, lag: Floats) -> Floats:
        return np.interp(lag, self.lags, self.rho)


def _design(slots: Floats) -> Floats:
    angle = 2 * math.pi * (slots % _DAY_SLOTS) / _DAY_SLOTS
    cols = []
    for k in range(1, _HARMONICS + 1):
        cols += [np.sin(k * angle), np.cos(k * angle)]
    return np.stack(cols, axis=1)


#: Lags (checks) at which the residual's memory is measured; interpolated between.
_LAGS = np.unique(np.round(np.geomspace(1, 6144, 24))).astype(np.float64)


def fit_route(values: Floats, first: int) -> RouteFit:
    """Fit ``values`` (one route, slots ``first`` on); see ``RouteFit``.

    The cycle is fitted with one level per day beside it, so a regime shift
    moves a day's level and not the cycle. How many harmonics it keeps (none
    to three) is chosen by leaving each day out in turn and predicting its
    shape from the others: a slow wander that happens to look daily over a
    few days does not predict the day it was not fitted on, and is left to
    the residual where it belongs.
    """
    n = len(values)
    slots = first + np.arange(n, dtype=np.float64)
    harmonics = np.zeros(2 * _HARMONICS)
    ok = np.isfinite(values)
    if ok.sum() > _DAY_SLOTS and n >= _DAY_SLOTS * 3 // 2:
        x = slots[ok]
        day = ((x - x[0]) // _DAY_SLOTS).astype(np.int64)
        harmonics = _cycle(_design(x), values[ok], day)
    profile = _design(np.arange(_DAY_SLOTS, dtype=np.float64)) @ harmonics
    resid = values - profile[(slots % _DAY_SLOTS).astype(np.int64)]
    level = _mean_level(resid)
    scale = float(np.nanstd(level)) if np.isfinite(level).sum() > 1 else 1.0
    rho = np.array([_memory(resid, level, int(lag)) for lag in _LAGS])
    rho = np.minimum.accumulate(np.clip(np.nan_to_num(rho, nan=0.0), 0.0, 1.0))
    return RouteFit(
        at=first + n - 1,
        harmonics=harmonics,
        lags=_LAGS,
        rho=rho,
        scale=max(scale, 1e-3),
        profile=profile,
    )


def _cycle(design: Floats, y: Floats, day: npt.NDArray[np.int64]) -> Floats:
    """Harmonic coefficients, the count chosen by leave-one-day-out error.

    Works on each day's centred sums (a level per day), so every fold is a
    6 x 6 solve whatever the history's length. Rare dips are clipped first
    (to five median absolute deviations), so a few deep minutes that happened
    to fall at similar hours do not pass for a cycle, and each harmonic pair
    must cut the error by 1 % to be kept.
    """
    centre = float(np.median(y))
    spread = 5 * 1.4826 * float(np.median(np.abs(y - centre)))
    y = np.clip(y, centre - spread, centre + spread)
    days = int(day.max()) + 1
    k = design.shape[1]
    hh = np.zeros((days, k, k))
    hy = np.zeros((days, k))
    yy = np.zeros(days)
    for d in range(days):
        rows = day == d
        if rows.sum() < 2:
            continue
        h = design[rows] - design[rows].mean(axis=0)
        v = y[rows] - y[rows].mean()
        hh[d], hy[d], yy[d] = h.T @ h, h.T @ v, v @ v
    full = np.zeros(k)
    if (yy > 0).sum() < 2:
        return full
    best_error, best = float(yy.sum()), 0
    for used in range(2, k + 1, 2):
        error = 0.0
        for d in range(days):
            rest = np.arange(days) != d
            a = hh[rest, :used, :used].sum(axis=0) + 1e-9 * np.eye(used)
            beta = np.linalg.solve(a, hy[rest, :used].sum(axis=0))
            error += yy[d] - 2 * beta @ hy[d, :used] + beta @ hh[d, :used, :used] @ beta
        if error < 0.99 * best_error:
            best_error, best = error, used
    if best:
        a = hh[:, :best, :best].sum(axis=0) + 1e-9 * np.eye(best)
        full[:best] = np.linalg.solve(a, hy[:, :best].sum(axis=0))
    return full


def _memory(resid: Floats, level: Floats, lag: int) -> float:
    """Slope of the residual ``lag`` checks on against the 2-minute mean now."""
    if lag >= len(resid):
        return math.nan
    now, then = level[:-lag], resid[lag:]
    ok = np.isfinite(now) & np.isfinite(then)
    if ok.sum() < 30:
        return math.nan
    a, b = now[ok] - now[ok].mean(), then[ok] - then[ok].mean()
    var = float((a * a).sum())
    return float((a * b).sum() / var) if var > 0 else 0.0


def _mean_level(resid: Floats) -> Floats:
    """The mean of the payable slots among the last ``_MEAN_SLOTS``: ``nan`` where none was."""
    ok = np.isfinite(resid)
    vals = np.where(ok, resid, 0.0)
    csum = np.concatenate([[0.0], np.cumsum(vals)])
    ccnt = np.concatenate([[0], np.cumsum(ok)])
    lo = np.maximum(np.arange(len(resid)) + 1 - _MEAN_SLOTS, 0)
    hi = np.arange(len(resid)) + 1
    count = ccnt[hi] - ccnt[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (csum[hi] - csum[lo]) / np.maximum(count, 1), np.nan)


def first_crossing(blocks: Floats, share: float = 0.25, least: int = 48) -> float | None:
    """Where, between a block's deepest price and a threshold, the first check past it lies.

    A plan that stops in a wide column stops at the first check that crosses
    its threshold, which the column's deepest price alone does not tell: it is
    that price when the column holds a plateau (a dip, a regime, a price fixed
    for a while), and nearer the threshold when prices are fresh draws. So it
    is measured on the route's own past, ``blocks[block, check]`` (depths,
    ``-inf`` unknown): for the threshold that the deepest ``share`` of the
    blocks cross, the mean over those blocks of (deepest - first crossing) /
    (deepest - threshold), 0 for a plateau. None with fewer than ``least``
    such blocks.
    """
    if blocks.shape[0] == 0:
        return None
    best = blocks.max(axis=1)
    known = np.isfinite(best)
    if known.sum() < least / share:
        return None
    threshold = float(np.quantile(best[known], 1 - share))
    over = known & (best > threshold)
    if over.sum() < least:
        return None
    rows = blocks[over]
    first = rows[np.arange(len(rows)), np.argmax(rows >= threshold, axis=1)]
    gap = best[over] - threshold
    return float(np.clip(np.mean((best[over] - first) / gap), 0.0, 1.0))


def _carry_forward(values: Floats) -> Floats:
    """The last known value at each slot (an outage hides the level, it does not end it)."""
    ok = np.isfinite(values)
    idx = np.where(ok, np.arange(len(values)), -1)
    np.maximum.accumulate(idx, out=idx)
    out = np.where(idx >= 0, values[np.maximum(idx, 0)], np.nan)
    return out


class ScenarioSource(Protocol):
    """Where a policy's futures come from: the past (``HistoryScenarios``) or, in the
    benchmark, the law that made the prices."""

    def scenarios(self, routes: Sequence[str], now: datetime) -> tuple[Floats, int] | None:
        """(discounts[scenario, column], checks covered) for the market of ``routes``.

        Column ``c`` holds the deepest discount any of the routes offers over
        checks ``COLUMNS.offsets[c]`` to ``COLUMNS.ends[c] - 1`` after the next
        (``-inf``: nothing payable). Columns past the cover are meaningless.
        None: no opinion (too little known to bet a deadline on).
        """
        ...


@dataclass
class _Past:
    """One route's past as analogues read it, computed at a refit and reused until the next.

    Arrays are indexed by slot from ``base`` (a multiple of the widest column,
    so that pooling a column is a reshape) to ``until``.
    """

    fit: RouteFit
    base: int
    until: int
    level: Floats  # 2-minute residual mean, carried over outages
    trend: Floats  # its change over the last half hour
    payable: Floats  # 1 or 0, carried over unknown slots
    pooled: dict[int, Floats]  # per column width: the deepest residual in each block
    charge: dict[int, float | None]  # per width above 1: ``first_crossing`` of its blocks

    @classmethod
    def of(cls, history: RouteHistory, now_slot: int, keep: int) -> _Past | None:
        if history.first is None:
            return None
        first = max(history.first, now_slot + 1 - keep)
        values = depth(history.window(first, now_slot + 1))
        fit = fit_route(values, first)
        base = first // _ALIGN * _ALIGN
        values = np.concatenate([np.full(first - base, np.nan), values])
        resid = values - fit.cycle(base + np.arange(len(values), dtype=np.float64))
        level = _carry_forward(_mean_level(resid))
        trend = np.full_like(level, np.nan)
        trend[_TREND_SLOTS:] = level[_TREND_SLOTS:] - level[:-_TREND_SLOTS]
        seen = ~np.isnan(resid)
        payable = _carry_forward(np.where(seen, np.isfinite(resid) * 1.0, np.nan))
        # Unknown slots count as unpayable: a policy that waits on what nobody saw
        # bets a deadline on it.
        clean = np.where(np.isnan(resid), -math.inf, resid)
        pooled = {}
        charge = {}
        for width in np.unique(COLUMNS.widths).tolist():
            usable = len(clean) // width * width
            blocks = clean[:usable].reshape(-1, width)
            pooled[width] = blocks.max(axis=1)
            if width > 1:
                charge[width] = first_crossing(blocks)
        return cls(fit, base, now_slot, level, trend, payable, pooled, charge)

    def state(self, history: RouteHistory, now_slot: int) -> tuple[float, float, float]:
        """(level, trend, payable) now, from the slots since the refit."""
        lo = now_slot + 1 - (_TREND_SLOTS + _MEAN_SLOTS)
        recent = depth(history.window(lo, now_slot + 1))
        resid = recent - self.fit.cycle(lo + np.arange(len(recent), dtype=np.float64))
        level = _mean_level(resid)
        before = self.level[min(len(self.level) - 1, now_slot - self.base)]
        level = _carry_forward(np.concatenate([[before], level]))[1:]
        seen = ~np.isnan(resid)
        status = np.where(seen, np.isfinite(resid) * 1.0, np.nan)
        pay = _carry_forward(np.concatenate([[self.payable[-1]], status]))[-1]
        return float(level[-1]), float(level[-1] - level[-1 - _TREND_SLOTS]), float(pay)


@dataclass
class HistoryScenarios:
    """Scenarios replayed from route histories; see the module docstring."""

    memory: timedelta = timedelta(days=7)
    #: How many analogues; fewer than ``min_analogues`` with any future means no opinion.
    analogues: int = 64
    min_analogues: int = 24
    #: The least future an analogue must have shown, in checks (an hour).
    min_cover: int = 240
    #: No opinion before the history spans a day (every hour of the day seen once):
    #: a worker that has seen a morning of falling prices has not seen them rise again.
    min_span: int = _DAY_SLOTS
    #: Analogues are drawn from at least this many slots (half a day) of starts, so a
    #: young history does not lend one stretch of itself to every scenario.
    min_starts: int = _DAY_SLOTS // 2
    #: How long a fit is reused, in slots (an hour; a young history refits every 15 minutes).
    refit: int = 240
    columns: Columns = COLUMNS
    histories: dict[str, RouteHistory] = field(default_factory=dict)
    _pasts: dict[str, _Past | None] = field(default_factory=dict)

    def history(self, route: str) -> RouteHistory:
        got = self.histories.get(route)
        if got is None:
            keep = int(self.memory / SLOT)
            got = self.histories[route] = RouteHistory(keep)
        return got

    def past(self, route: str, now_slot: int) -> _Past | None:
        """The route's past as of its last refit, refitted when stale."""
        history = self.history(route)
        got = self._pasts.get(route)
        young = history.span() < _DAY_SLOTS * 3 // 2
        every = self.refit // 4 if young else self.refit
        if got is None or now_slot - got.until >= every or now_slot < got.until:
            got = self._pasts[route] = _Past.of(history, now_slot, history.keep)
        return got

    def charges(self, routes: Sequence[str], now: datetime) -> dict[int, float]:
        """Per column width above 1, the routes' mean ``first_crossing`` (where measured)."""
        now_slot = slot_index(now)
        got: dict[int, list[float]] = {}
        for route in routes:
            history = self.history(route)
            if history.first is None or now_slot - history.first < self.min_span:
                continue
            past = self.past(route, now_slot)
            for width, value in ({} if past is None else past.charge).items():
                if value is not None:
                    got.setdefault(width, []).append(value)
        return {width: float(np.mean(values)) for width, values in got.items()}

    def scenarios(self, routes: Sequence[str], now: datetime) -> tuple[Floats, int] | None:
        now_slot = slot_index(now)
        # A route too young to replay, or never payable, is left out: without it the
        # scenarios only look dearer and hold fewer chances, which errs towards now.
        usable: list[tuple[_Past, float, float, float]] = []
        for route in routes:
            history = self.history(route)
            if history.first is None or now_slot - history.first < self.min_span:
                continue
            past = self.past(route, now_slot)
            if past is None:
                continue
            level, trend, pay = past.state(history, now_slot)
            if math.isfinite(level):
                usable.append((past, level, trend, pay))
        if not usable:
            return None
        # Candidate analogues: slots whose next one starts an aligned column layout,
        # with a half-hour behind them and at least ``min_cover`` known after.
        lo = max(p.base for p, *_ in usable) + _TREND_SLOTS
        hi = min(p.until for p, *_ in usable)
        first = (lo + 1 + _ALIGN - 1) // _ALIGN * _ALIGN - 1
        starts = np.arange(first, hi - self.min_cover + 1, _ALIGN, dtype=np.int64)
        if len(starts) < self.min_analogues:
            return None
        room = hi - starts
        ends = self.columns.ends
        longest = hi - lo - self.min_starts
        fits = [
            int(e) for e in ends if e <= longest and int((room >= e).sum()) >= self.min_analogues
        ]
        if not fits:
            return None
        cover = max(fits)
        starts = starts[room >= cover]
        dist = np.zeros(len(starts))
        for past, level, trend, pay in usable:
            at = starts - past.base
            d_level = (past.level[at] - level) / past.fit.scale
            d_trend = (past.trend[at] - (trend if math.isfinite(trend) else 0.0)) / past.fit.scale
            d_pay = past.payable[at] - pay
            dist += np.nan_to_num(d_level**2 + 0.5 * d_trend**2 + 9.0 * d_pay**2, nan=1e6)
        chosen = starts[np.argsort(dist, kind="stable")[: self.analogues]]

        cols = self.columns
        mids = cols.offsets + (cols.widths - 1) / 2
        out = np.full((len(chosen), len(cols.widths)), -math.inf)
        future = now_slot + 1 + mids
        for past, level, _, pay in usable:
            at = chosen - past.base
            ahead = np.empty_like(out)
            for width, pooled in past.pooled.items():
                which = cols.widths == width
                block = (at[:, None] + 1 + cols.offsets[which][None, :]) // width
                ahead[:, which] = pooled[np.minimum(block, len(pooled) - 1)]
            gap = np.nan_to_num(level - past.level[at])
            ahead += gap[:, None] * past.fit.memory(mids + 1)[None, :]
            ahead += past.fit.cycle(future)[None, :]
            if pay < 0.5:
                # Unpayable now: count on it only where its analogue was unpayable too,
                # and so shows how long such an outage lasted.
                ahead[past.payable[at] >= 0.5, :] = -math.inf
            np.maximum(out, np.nan_to_num(ahead, nan=-math.inf), out=out)
        out[:, cols.ends > cover] = -math.inf
        return discount(out), cover
