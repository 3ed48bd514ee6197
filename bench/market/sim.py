"""The worker, replayed: items arrive in bursts, a pass every 15 s dispatches at most ten.

``Market`` turns a trace into what the worker sees at each check: one
``RouteOffer`` per route with fresh ``Decimal`` prices (none while a feed is
dark). ``replay`` runs a policy exactly as the deferred-batch worker
(``batchyard.work.deferred_batches.deferred_batch_worker``) does:
pending items most urgent deadline first, ``choose`` for each until ten are
chosen in the pass, the market shown to a learning policy at every check,
quiet or not, every pending item asked in order (a policy may learn the queue
from who it is asked about, as the worker shows it).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal

import numpy as np
import numpy.typing as npt
from bench.market.laws import Family
from bench.market.trace import CHECK_S, PER_DAY, PER_HOUR, START, Trace, time_of

from batchyard.core.market import Item, Policy, RouteOffer, offer_cost, qualifies
from batchyard.core.prices import Price
from batchyard.core.route_history import slot_index

Floats = npt.NDArray[np.float64]

#: Days the worker watched the market before the measured day (its saved history);
#: then the day whose submissions are measured, and a day for their deadlines.
WARMUP_DAYS = 3
DAYS = WARMUP_DAYS + 2
DAWN = WARMUP_DAYS * PER_DAY
DIRECT = Price(Decimal("1.00"), Decimal("4.00"))
WINDOWS = ((timedelta(hours=1), 0.3), (timedelta(hours=6), 0.3), (timedelta(hours=24), 0.4))
PER_PASS = 10


@dataclass
class SimItem:
    item: Item
    first: int  # first check at or after submission
    last: int  # last check before the deadline
    best: float | None = None  # the hindsight optimum: cheapest qualifying cost in the window


@dataclass
class _Route:
    name: str
    price_in: Floats  # nan where dark
    price_out: Floats
    caps: bool
    fallback: _Route | None = None

    def discount(self) -> Floats:
        """Guaranteed discount (shallowest rate, route and fallbacks); -inf if unpayable."""
        own = 100 * (1 - np.maximum(self.price_in / 1.0, self.price_out / 4.0))
        own = np.where(np.isnan(own) | (not self.caps), -math.inf, own)
        if self.fallback is not None:
            own = np.minimum(own, self.fallback.discount())
        return own

    def cost(self, input_tokens: int, output_tokens: int, lo: int, hi: int) -> Floats:
        own = (input_tokens * self.price_in[lo:hi] + output_tokens * self.price_out[lo:hi]) / 1e6
        if self.fallback is not None:
            own = np.maximum(own, self.fallback.cost(input_tokens, output_tokens, lo, hi))
        return own


class Market:
    """What the worker sees of a trace: offers per check, and the floats the bench scores with."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.n = trace.n
        self.routes = [self._route(trace, r) for r in trace.routes]
        self.discounts = np.stack([r.discount() for r in self.routes])
        self.deepest = self.discounts.max(axis=0)
        self._offers: dict[int, tuple[RouteOffer, ...]] = {}

    @staticmethod
    def _route(trace: Trace, route: object) -> _Route:
        from bench.market.trace import RouteTrace

        assert isinstance(route, RouteTrace)
        level = trace.level(route)
        skew = route.law.skew
        return _Route(
            route.law.name,
            np.round(level * (1 + skew), 6),
            np.round(level * (1 - skew) * 4, 6),
            route.law.caps,
            None if route.fallback is None else Market._route(trace, route.fallback),
        )

    def offers(self, k: int) -> tuple[RouteOffer, ...]:
        got = self._offers.get(k)
        if got is None:
            got = self._offers[k] = tuple(_offer(r, k) for r in self.routes)
        return got

    def history(self, until: int, since: int = 0) -> dict[str, list[tuple[int, float | None]]]:
        """What a worker watching every check from ``since`` to ``until`` saved, per route."""
        first = slot_index(START) + max(0, since)
        out = {}
        for route, row in zip(self.routes, self.discounts, strict=True):
            values = row[max(0, since) : until].tolist()
            out[route.name] = [
                (first + k, None if math.isinf(v) else float(v)) for k, v in enumerate(values)
            ]
        return out


def _offer(route: _Route, k: int) -> RouteOffer:
    fallbacks = () if route.fallback is None else (_offer(route.fallback, k),)
    pin, pout = route.price_in[k], route.price_out[k]
    price = None if math.isnan(pin) else Price(Decimal(f"{pin:.6f}"), Decimal(f"{pout:.6f}"))
    return RouteOffer(route.name, price, route.caps, fallbacks)


def make_items(fam: Family, seed: int, count: int, day: int = WARMUP_DAYS) -> list[SimItem]:
    """About ``count`` items over ``day``, in submissions of 1-50 (bursts that share a deadline)."""
    rng = random.Random(f"items/{fam.name}/{seed}/{day}")
    windows = [w for w, _ in WINDOWS]
    weights = [p for _, p in WINDOWS]
    out: list[SimItem] = []
    while len(out) < count:
        size = min(50, 1 + int(rng.expovariate(1 / 5)), count - len(out))
        first = day * PER_DAY + rng.randrange(0, PER_DAY)
        submitted = START + timedelta(seconds=first * CHECK_S - rng.uniform(0, CHECK_S - 1))
        window = rng.choices(windows, weights)[0]
        minimum = Decimal(rng.choice(fam.minima))
        deadline = submitted + window
        last = math.ceil((deadline - START).total_seconds() / CHECK_S) - 1
        for _ in range(size):
            item = Item(
                id=f"item-{len(out)}",
                min_discount=minimum,
                deadline=deadline,
                submitted_at=submitted,
                input_tokens=rng.randint(200, 4000),
                max_output_tokens=rng.choice((64, 256, 1024)),
            )
            out.append(SimItem(item, first, last))
    return out


def hindsight(market: Market, items: Sequence[SimItem]) -> None:
    """The cheapest qualifying cost each item could have had, knowing the whole window."""
    for sim in items:
        lo, hi = sim.first, min(market.n, sim.last + 1)
        m = float(sim.item.min_discount)
        best = math.inf
        for route, disc in zip(market.routes, market.discounts, strict=True):
            ok = disc[lo:hi] >= m
            if ok.any():
                cost = route.cost(sim.item.input_tokens, sim.item.max_output_tokens, lo, hi)
                best = min(best, float(cost[ok].min()))
        sim.best = None if math.isinf(best) else best


@dataclass
class Paid:
    cost: dict[str, float] = field(default_factory=dict)


def replay(policy: Policy, market: Market, items: Sequence[SimItem], start: int) -> Paid:
    """Run ``policy`` as the worker would from check ``start``; what it paid per item."""
    arrivals: dict[int, list[SimItem]] = {}
    for sim in items:
        arrivals.setdefault(max(start, sim.first), []).append(sim)
    last_check = max(s.last for s in items)
    pending: list[tuple[float, str, SimItem]] = []
    paid = Paid()
    observe = getattr(policy, "observe", None)
    for k in range(start, min(market.n, last_check + 1)):
        for sim in arrivals.get(k, ()):
            bisect.insort(pending, (sim.item.deadline.timestamp(), sim.item.id, sim))
        now = time_of(k)
        offers = market.offers(k)
        if callable(observe):
            observe(offers, DIRECT, now)
        if not pending:
            continue
        chosen = 0
        keep: list[tuple[float, str, SimItem]] = []
        for entry in pending:
            sim = entry[2]
            if k > sim.last:
                continue  # expired
            if chosen >= PER_PASS:
                keep.append(entry)
                continue
            offer = policy.choose(sim.item, offers, DIRECT, now)
            if offer is None:
                keep.append(entry)
                continue
            assert qualifies(offer, DIRECT, sim.item.min_discount), "a policy broke the rule"
            paid.cost[sim.item.id] = float(
                offer_cost(offer, sim.item.input_tokens, sim.item.max_output_tokens)
            )
            chosen += 1
        pending = keep
    return paid


__all__ = [
    "DAWN",
    "DAYS",
    "DIRECT",
    "PER_HOUR",
    "PER_PASS",
    "WARMUP_DAYS",
    "Market",
    "Paid",
    "SimItem",
    "hindsight",
    "make_items",
    "replay",
]
