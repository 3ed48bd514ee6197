"""How much does waiting for the deadline save over dispatching at the first chance?

Generates price traces for several market shapes, replays deferred items
against them with a check every 15 s (the worker's pass interval), and prints,
per scenario and policy, what was paid as a multiple of the hindsight-optimal
cost (the cheapest qualifying price each item saw before its deadline) and
the share of deadlines met among items where a qualifying price appeared.

    PYTHONPATH=src python bench/market.py [--seed N] [--items N]

The policies are the real ones from ``batchyard.core.market``, called at
every check exactly as the worker calls them, in time order (and shown the
market on quiet checks too, as the worker does), so a policy that learns from
what it sees learns here as it would in production. The worker has watched
the market for ``WARMUP_DAYS`` days before the measured day, as a deployed
one has (it saves what it saw and restores it on restart); the "cold" row is
a worker started at the measured day's dawn with nothing saved.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from rich.console import Console
from rich.table import Table

from batchyard.core.market import (
    DeadlineAware,
    FirstEligible,
    Item,
    Policy,
    RouteOffer,
    offer_cost,
    qualifies,
)
from batchyard.core.prices import Price

CHECK_S = 15
PER_HOUR = 3600 // CHECK_S
#: Days of the market a worker has seen before the measured day (its saved
#: history); then a measured day of submissions, and a day for their deadlines.
WARMUP_DAYS = 3
N_CHECKS = (WARMUP_DAYS + 2) * 24 * PER_HOUR
START = datetime(2026, 3, 2, tzinfo=UTC)
DIRECT = Price(Decimal("1.00"), Decimal("4.00"))
WINDOWS = ((timedelta(hours=1), 0.3), (timedelta(hours=6), 0.3), (timedelta(hours=24), 0.4))
MIN_DISCOUNTS = (Decimal(30), Decimal(40), Decimal(50))

# A level is the route's price as a share of the direct price (None: no fresh price).
Levels = list[float | None]


@dataclass(frozen=True)
class RouteSpec:
    name: str
    levels: Levels
    hard_caps: bool = True
    fallbacks: tuple[RouteSpec, ...] = ()


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    routes: tuple[RouteSpec, ...]


# --- price shapes --------------------------------------------------------------------


def _per_minute(rng: random.Random, step: Callable[[int, float], float], start: float) -> Levels:
    """Prices move once a minute (a feed polled every minute); checks run every 15 s."""
    out: Levels = []
    level = start
    for k in range(N_CHECKS):
        if k % 4 == 0:
            level = step(k, level)
        out.append(level)
    return out


def drifting(rng: random.Random, centre: float = 0.55, vol: float = 0.02) -> Levels:
    def step(_k: int, level: float) -> float:
        log_level = math.log(level)
        log_level += 0.004 * (math.log(centre) - log_level) + rng.gauss(0, vol)
        return min(1.3, max(0.08, math.exp(log_level)))

    return _per_minute(rng, step, centre)


def daily(rng: random.Random, mean: float = 0.55, amp: float = 0.35) -> Levels:
    phase = rng.uniform(0, 2 * math.pi)
    wobble = [0.0]

    def step(k: int, _level: float) -> float:
        # Providers' prices move in steps, not in independent per-minute jitter:
        # a slowly wandering wobble on top of the daily cycle.
        hours = k / PER_HOUR
        wobble[0] = 0.97 * wobble[0] + rng.gauss(0, 0.006)
        swing = amp * math.sin(2 * math.pi * hours / 24 + phase)
        return max(0.05, mean + swing + wobble[0])

    return _per_minute(rng, step, mean)


def dips(rng: random.Random, base: float = 0.62, every_h: float = 4.0) -> Levels:
    # Between dips the price wanders a little around its base (a slow AR
    # process, not per-minute noise: a spot price holds for a while).
    def step(_k: int, level: float) -> float:
        return max(0.3, level + 0.05 * (base - level) + rng.gauss(0, 0.006))

    levels = _per_minute(rng, step, base)
    k = 0
    while True:
        k += int(rng.expovariate(1 / (every_h * PER_HOUR)))
        if k >= N_CHECKS:
            return levels
        length = rng.randint(5, 20) * 4  # 5-20 minutes
        depth = rng.uniform(0.12, 0.3)
        for j in range(k, min(N_CHECKS, k + length)):
            levels[j] = depth


def with_gaps(rng: random.Random, levels: Levels, every_h: float = 3.0) -> Levels:
    out = list(levels)
    k = 0
    while True:
        k += int(rng.expovariate(1 / (every_h * PER_HOUR)))
        if k >= N_CHECKS:
            return out
        for j in range(k, min(N_CHECKS, k + rng.randint(20, 90) * 4)):
            out[j] = None


def scenarios(seed: int) -> list[Scenario]:
    rng = random.Random(seed)
    return [
        Scenario("drifting", "one route, price wanders", (RouteSpec("a", drifting(rng)),)),
        Scenario("daily", "one route, daily swing", (RouteSpec("a", daily(rng)),)),
        Scenario("dips", "one route, short deep dips", (RouteSpec("a", dips(rng)),)),
        Scenario(
            "several routes",
            "daily, drifting, dips; a cheap one whose fallback has no caps",
            (
                RouteSpec("daily", daily(rng, mean=0.6)),
                RouteSpec("drift", drifting(rng, centre=0.6)),
                RouteSpec("dips", dips(rng, base=0.7, every_h=6)),
                RouteSpec(
                    "uncapped-fallback",
                    daily(rng, mean=0.3, amp=0.1),
                    fallbacks=(RouteSpec("fb", daily(rng, mean=0.3, amp=0.1), hard_caps=False),),
                ),
            ),
        ),
        Scenario(
            "stale gaps",
            "daily swing; the feed drops out for 20-90 min",
            (RouteSpec("a", with_gaps(rng, daily(rng))),),
        ),
    ]


# --- replay --------------------------------------------------------------------------


def _price(level: float, skew: float) -> Price:
    # The two rates move together but not in lockstep, so "both rates" matters.
    return Price(Decimal(f"{level * (1 + skew):.4f}"), Decimal(f"{level * (1 - skew):.4f}") * 4)


def build_offers(scenario: Scenario) -> list[tuple[RouteOffer, ...]]:
    """The offers at every check, built once and shared by every item and policy."""
    skews: dict[str, float] = {}
    rng = random.Random(scenario.name)
    cache: dict[tuple[str, float | None], RouteOffer] = {}

    def offer(spec: RouteSpec, k: int) -> RouteOffer:
        level = spec.levels[k]
        fallbacks = tuple(offer(fb, k) for fb in spec.fallbacks)
        if fallbacks:
            return RouteOffer(spec.name, _level_price(spec, level), spec.hard_caps, fallbacks)
        key = (spec.name, level)
        if key not in cache:
            cache[key] = RouteOffer(spec.name, _level_price(spec, level), spec.hard_caps)
        return cache[key]

    def _level_price(spec: RouteSpec, level: float | None) -> Price | None:
        if level is None:
            return None
        skew = skews.setdefault(spec.name, rng.uniform(-0.05, 0.05))
        return _price(level, skew)

    return [tuple(offer(spec, k) for spec in scenario.routes) for k in range(N_CHECKS)]


@dataclass
class SimItem:
    item: Item
    first: int  # first check at or after submission
    last: int  # last check before the deadline
    best: float | None = None  # hindsight-optimal cost


def make_items(seed: int, count: int, day: int = 1) -> list[SimItem]:
    """``count`` items submitted at random over ``day`` (0: the warm-up day)."""
    rng = random.Random(seed * 7919 + 1 + 104729 * day)
    windows = [w for w, _ in WINDOWS]
    weights = [p for _, p in WINDOWS]
    out: list[SimItem] = []
    for n in range(count):
        first = day * 24 * PER_HOUR + rng.randrange(0, 24 * PER_HOUR)
        submitted = START + timedelta(seconds=first * CHECK_S - rng.uniform(0, CHECK_S - 1))
        window = rng.choices(windows, weights)[0]
        deadline = submitted + window
        last = min(N_CHECKS - 1, math.ceil((deadline - START).total_seconds() / CHECK_S) - 1)
        item = Item(
            id=f"item-{day}-{n}",
            min_discount=rng.choice(MIN_DISCOUNTS),
            deadline=deadline,
            submitted_at=submitted,
            input_tokens=rng.randint(200, 4000),
            max_output_tokens=rng.choice((64, 256, 1024)),
        )
        out.append(SimItem(item, first, last))
    return out


def hindsight(items: Sequence[SimItem], offers: Sequence[tuple[RouteOffer, ...]]) -> None:
    """The cheapest qualifying cost each item could have had, knowing the whole window."""
    rates: dict[int, tuple[float, float]] = {}
    qual: dict[tuple[int, Decimal], bool] = {}
    for sim in items:
        md = sim.item.min_discount
        best: float | None = None
        for k in range(sim.first, sim.last + 1):
            for offer in offers[k]:
                key = (id(offer), md)
                ok = qual.get(key)
                if ok is None:
                    ok = qual[key] = qualifies(offer, DIRECT, md)
                if not ok:
                    continue
                r = rates.get(id(offer))
                if r is None:
                    r = rates[id(offer)] = (
                        float(offer_cost(offer, 1_000_000, 0)),
                        float(offer_cost(offer, 0, 1_000_000)),
                    )
                cost = (r[0] * sim.item.input_tokens + r[1] * sim.item.max_output_tokens) / 1e6
                if best is None or cost < best:
                    best = cost
        sim.best = best


def replay(
    policy: Policy,
    items: Sequence[SimItem],
    offers: Sequence[tuple[RouteOffer, ...]],
    start: int = 0,
) -> dict[str, float]:
    """Run the policy at every check from ``start`` in time order; return what it paid.

    Like the worker, it shows a policy that learns the market on passes with
    nothing waiting too.
    """
    by_first: dict[int, list[SimItem]] = {}
    for sim in items:
        by_first.setdefault(max(start, sim.first), []).append(sim)
    pending: list[SimItem] = []
    paid: dict[str, float] = {}
    observe = getattr(policy, "observe", None)
    for k in range(start, N_CHECKS):
        pending.extend(by_first.get(k, ()))
        now = START + timedelta(seconds=k * CHECK_S)
        here = offers[k]
        if not pending:
            if callable(observe):
                observe(here, DIRECT, now)
            continue
        still: list[SimItem] = []
        for sim in pending:
            if k > sim.last:
                continue  # expired
            chosen = policy.choose(sim.item, here, DIRECT, now)
            if chosen is None:
                still.append(sim)
                continue
            assert qualifies(chosen, DIRECT, sim.item.min_discount), "policy broke the rule"
            paid[sim.item.id] = float(
                offer_cost(chosen, sim.item.input_tokens, sim.item.max_output_tokens)
            )
        pending = still
    return paid


@dataclass
class Outcome:
    policy: str
    chances: int  # items where a qualifying price appeared before the deadline
    met: int
    ratio_total: float  # sum paid / sum hindsight, over items dispatched
    ratio_median: float
    ratio_p95: float
    saving: float  # share below the direct price, over items dispatched


def measure(name: str, items: Sequence[SimItem], paid: dict[str, float]) -> Outcome:
    chances = [s for s in items if s.best is not None]
    done = [s for s in chances if s.item.id in paid]
    ratios = sorted(paid[s.item.id] / s.best for s in done if s.best)
    total_paid = sum(paid[s.item.id] for s in done)
    total_best = sum(s.best for s in done if s.best is not None)
    total_direct = sum(
        float(offer_cost(RouteOffer("direct", DIRECT, True), s.item.input_tokens, 0))
        + float(offer_cost(RouteOffer("direct", DIRECT, True), 0, s.item.max_output_tokens))
        for s in done
    )
    return Outcome(
        policy=name,
        chances=len(chances),
        met=len(done),
        ratio_total=total_paid / total_best if total_best else math.nan,
        ratio_median=statistics.median(ratios) if ratios else math.nan,
        ratio_p95=ratios[min(len(ratios) - 1, int(0.95 * len(ratios)))] if ratios else math.nan,
        saving=1 - total_paid / total_direct if total_direct else math.nan,
    )


@dataclass(frozen=True)
class Contender:
    """A policy, and whether the worker running it has seen the warm-up days."""

    name: str
    make: Callable[[], Policy]
    warm: bool = True


CONTENDERS = (
    Contender("first-eligible", FirstEligible),
    Contender("deadline-aware", DeadlineAware),
    # A worker started at the measured day's dawn with no saved history.
    Contender("deadline-aware, cold", DeadlineAware, warm=False),
)


def run_scenario(
    scenario: Scenario, contenders: Sequence[Contender], seed: int, count: int
) -> list[Outcome]:
    offers = build_offers(scenario)
    # The worker has been running for WARMUP_DAYS days: the same traffic then
    # feeds what a learning policy sees, but only the next day's items are measured.
    warmup = [sim for day in range(WARMUP_DAYS) for sim in make_items(seed, count, day=day)]
    items = make_items(seed, count, day=WARMUP_DAYS)
    hindsight(items, offers)
    dawn = WARMUP_DAYS * 24 * PER_HOUR
    outcomes = []
    for contender in contenders:
        policy = contender.make()  # fresh: one that learns must not carry a market over
        if contender.warm:
            paid = replay(policy, [*warmup, *items], offers)
        else:
            paid = replay(policy, items, offers, start=dawn)
        outcomes.append(measure(contender.name, items, paid))
    return outcomes


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--items", type=int, default=200)
    args = parser.parse_args(argv)

    console = Console()
    started = time.perf_counter()
    totals: dict[str, list[Outcome]] = {c.name: [] for c in CONTENDERS}
    for scenario in scenarios(args.seed):
        outcomes = run_scenario(scenario, CONTENDERS, args.seed, args.items)
        table = Table(title=f"{scenario.name}: {scenario.about}", title_justify="left")
        table.add_column("policy")
        table.add_column("deadlines met", justify="right")
        table.add_column("paid / best", justify="right")
        table.add_column("median", justify="right")
        table.add_column("p95", justify="right")
        table.add_column("saved", justify="right")
        for o in outcomes:
            totals[o.policy].append(o)
            table.add_row(
                o.policy,
                f"{o.met}/{o.chances}",
                f"{o.ratio_total:.2f}",
                f"{o.ratio_median:.2f}",
                f"{o.ratio_p95:.2f}",
                f"{o.saving:.0%}",
            )
        console.print(table)
    elapsed = time.perf_counter() - started
    console.print(
        f"[bold]summary[/] seed={args.seed} items={args.items} per scenario, "
        f"check every {CHECK_S}s, {elapsed:.1f}s"
    )
    for name, outs in totals.items():
        met = sum(o.met for o in outs)
        chances = sum(o.chances for o in outs)
        worst = max(o.ratio_total for o in outs)
        mean = statistics.fmean(o.ratio_total for o in outs)
        console.print(
            f"  {name:<15} deadlines met {met}/{chances}; paid x hindsight: "
            f"mean {mean:.2f}, worst scenario {worst:.2f}"
        )


if __name__ == "__main__":
    main()
