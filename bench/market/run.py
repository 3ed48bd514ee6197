"""One family and seed: draw the market, replay every contender, score them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.market.exact import ExactStopping
from bench.market.laws import family
from bench.market.reference import Present, Reference
from bench.market.sim import (
    DAWN,
    DAYS,
    WARMUP_DAYS,
    Market,
    SimItem,
    hindsight,
    make_items,
    replay,
)
from bench.market.trace import PER_DAY, Trace, TrueLaw

from batchyard.core.market import DeadlineAware, FirstEligible, Policy

__all__ = ["CONTENDERS", "ONLINE", "TRUE_LAW", "Contender", "Result", "run_family"]

ONLINE = "reference"
TRUE_LAW = "deadline-aware, true law"


@dataclass(frozen=True)
class Contender:
    """A policy, and what the worker running it knew at the measured day's dawn."""

    name: str
    make: Callable[[Trace, Market, Sequence[SimItem]], Policy]
    #: Days of history restored at dawn, as a deployed worker restores what it saved
    #: (None: all the warm-up days; 0: a worker started with nothing saved).
    days: float | None = None


def _law(trace: Trace, _m: Market, _i: Sequence[SimItem]) -> Policy:
    return DeadlineAware(scenarios=TrueLaw(trace), name=TRUE_LAW)


def _reference(trace: Trace, _m: Market, _i: Sequence[SimItem]) -> Policy:
    return Reference(Present(trace))


CONTENDERS: tuple[Contender, ...] = (
    Contender("first-eligible", lambda *_: FirstEligible()),
    Contender("deadline-aware", lambda *_: DeadlineAware()),
    # Its first days: a worker that saved one day, and one started at dawn with nothing.
    Contender("deadline-aware, 1 day", lambda *_: DeadlineAware(), days=1),
    Contender("deadline-aware, cold", lambda *_: DeadlineAware(), days=0),
    # The same policy handed the family's law instead of its history: what knowing the
    # law is worth, and what is left to solving the stopping problem.
    Contender(TRUE_LAW, _law),
    Contender(ONLINE, _reference),
)
#: Only where the law allows it to be computed exactly (one route, cycle + fresh noise).
EXACT = Contender("exact optimum", lambda t, m, i: ExactStopping(t, m, i))


@dataclass
class Result:
    family: str
    seed: int
    items: list[SimItem]
    paid: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def run_family(
    name: str, seed: int, count: int, contenders: Sequence[Contender] = CONTENDERS
) -> Result:
    fam = family(name, seed)
    trace = Trace(fam, seed, DAYS)
    market = Market(trace)
    items = make_items(fam, seed, count)
    hindsight(market, items)
    result = Result(name, seed, items)
    chosen = list(contenders)
    if ExactStopping.applies(fam):
        chosen.append(EXACT)
    for contender in chosen:
        started = time.perf_counter()
        policy = contender.make(trace, market, items)
        days = WARMUP_DAYS if contender.days is None else contender.days
        if days and hasattr(policy, "restore"):
            policy.restore(market.history(DAWN, since=DAWN - int(days * PER_DAY)))
        result.paid[contender.name] = replay(policy, market, items, DAWN).cost
        if isinstance(policy, Reference):  # it read nothing the replay had not shown
            assert policy.present.latest_read <= policy.present.now
        result.seconds[contender.name] = time.perf_counter() - started
    return result
