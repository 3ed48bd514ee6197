"""The price laws the market bench draws from: families, and which are tuned on.

A route's price, as a share of the direct price, is the exponential of a sum
of parts, each optional, each a Markov process whose state is known at every
check (so the reference can be handed the law and the present state):

* a level that may jump to a fresh level and stay there (regime shifts);
* a daily cycle with the route's own phase;
* a slow mean-reverting wander (AR(1) in log price), and one shared by all
  routes of the market;
* a price re-drawn every few minutes (an auction or a provider's schedule);
* noise at every 15-second check, Gaussian or heavy-tailed;
* rare dips that multiply the price for a few minutes.

A route may also go dark (no fresh price) for a while, alone or with the
whole feed. Episodes (dips, outages, regimes) start and end memorylessly, so
their remaining length never depends on how long they have lasted.

Each family draws its parameters from its seed, so two seeds of a family are
two markets of the same kind, not the same market twice.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FAMILIES", "HELD_OUT", "TRAIN", "Family", "RouteLaw", "family"]


@dataclass(frozen=True)
class RouteLaw:
    name: str
    #: Median price as a share of the direct price.
    base: float
    #: Daily swing of the log price (amplitude), and the hour of its peak.
    cycle: float = 0.0
    phase_h: float = 0.0
    #: Stationary spread and half-life of the slow wander of the log price.
    wander: float = 0.0
    wander_half_life_h: float = 2.0
    #: Spread of the per-check noise of the log price; ``noise_df`` > 0 draws it
    #: from a Student t with that many degrees of freedom (heavy tails).
    noise: float = 0.0
    noise_df: float = 0.0
    #: Dips: mean hours between them, mean length in minutes, and the factor
    #: (drawn log-uniformly from the range) the price is multiplied by.
    dip_every_h: float = 0.0
    dip_minutes: float = 10.0
    dip_factor: tuple[float, float] = (0.2, 0.5)
    #: Regimes: mean hours between jumps; each new level is ``base`` times a
    #: factor drawn log-uniformly from the range.
    regime_every_h: float = 0.0
    regime_range: tuple[float, float] = (0.5, 1.5)
    #: A price re-drawn every ``step_minutes`` (log-normal spread ``step``).
    step_minutes: int = 0
    step: float = 0.0
    #: Outages of this route's feed: mean hours between, mean minutes long.
    gap_every_h: float = 0.0
    gap_minutes: float = 45.0
    #: Input rate = level x (1 + skew), output = 4 x level x (1 - skew).
    skew: float = 0.0
    caps: bool = True
    fallback: RouteLaw | None = None


@dataclass(frozen=True)
class Family:
    name: str
    about: str
    routes: tuple[RouteLaw, ...]
    #: The minimum discounts (percent) submissions ask for.
    minima: tuple[int, ...]
    #: A slow wander shared by every route (log price).
    common: float = 0.0
    common_half_life_h: float = 3.0
    #: Outages of the whole feed.
    feed_gap_every_h: float = 0.0
    feed_gap_minutes: float = 30.0


def _phase(rng: random.Random) -> float:
    return rng.uniform(0, 24)


def reverting(rng: random.Random) -> Family:
    routes = tuple(
        RouteLaw(
            f"r{i}",
            base=rng.uniform(0.45, 0.65),
            wander=rng.uniform(0.15, 0.3),
            wander_half_life_h=rng.uniform(0.5, 3.0),
            noise=rng.uniform(0.03, 0.08),
            skew=rng.uniform(-0.04, 0.04),
        )
        for i in range(rng.choice((1, 2, 3)))
    )
    return Family("reverting", "mean-reverting wander, noise every check", routes, (30, 40, 50, 60))


def diurnal(rng: random.Random) -> Family:
    routes = tuple(
        RouteLaw(
            f"d{i}",
            base=rng.uniform(0.4, 0.6),
            cycle=rng.uniform(0.3, 0.6),
            phase_h=_phase(rng),
            wander=0.08,
            wander_half_life_h=2.0,
            noise=rng.uniform(0.02, 0.05),
            skew=rng.uniform(-0.04, 0.04),
        )
        for i in range(rng.choice((2, 3, 4)))
    )
    return Family("diurnal", "daily cycles, each route its own phase", routes, (40, 55, 70))


def dips(rng: random.Random) -> Family:
    routes = tuple(
        RouteLaw(
            f"p{i}",
            base=rng.uniform(0.5, 0.7),
            wander=0.05,
            wander_half_life_h=1.0,
            noise=rng.uniform(0.02, 0.04),
            dip_every_h=rng.uniform(3, 8),
            dip_minutes=rng.uniform(6, 15),
            dip_factor=(0.06, 0.3),
            skew=rng.uniform(-0.03, 0.03),
        )
        for i in range(rng.choice((1, 2)))
    )
    return Family("dips", "rare deep dips of a few minutes", routes, (50, 75, 90, 95))


def cycle_noise(rng: random.Random) -> Family:
    route = RouteLaw(
        "c0", base=rng.uniform(0.4, 0.6), cycle=rng.uniform(0.3, 0.5), phase_h=_phase(rng),
        noise=rng.uniform(0.05, 0.1),
    )  # fmt: skip
    return Family("cycle+noise", "one route: a daily cycle and fresh noise each check "
                  "(its exact optimum is computable)", (route,), (40, 60))  # fmt: skip


def regimes(rng: random.Random) -> Family:
    routes = tuple(
        RouteLaw(
            f"g{i}",
            base=rng.uniform(0.5, 0.8),
            regime_every_h=rng.uniform(4, 12),
            regime_range=(0.35, 1.6),
            wander=0.05,
            wander_half_life_h=1.0,
            noise=rng.uniform(0.02, 0.05),
            skew=rng.uniform(-0.05, 0.05),
        )
        for i in range(rng.choice((3, 4, 5)))
    )
    return Family("regimes", "levels jump and stay (regime shifts)", routes, (10, 30, 50))


def stale_feed(rng: random.Random) -> Family:
    routes = tuple(
        RouteLaw(
            f"s{i}",
            base=rng.uniform(0.4, 0.6),
            cycle=rng.uniform(0.2, 0.5),
            phase_h=_phase(rng),
            wander=0.1,
            wander_half_life_h=1.5,
            noise=0.03,
            gap_every_h=rng.uniform(2, 5),
            gap_minutes=rng.uniform(20, 60),
            skew=rng.uniform(-0.04, 0.04),
        )
        for i in range(rng.choice((1, 2, 3)))
    )
    return Family(
        "stale-feed",
        "daily cycles; routes and the whole feed go dark for 20-90 minutes",
        routes,
        (40, 55, 70),
        feed_gap_every_h=rng.uniform(6, 10),
        feed_gap_minutes=30.0,
    )


def auction(rng: random.Random) -> Family:
    count = rng.choice((4, 5, 6))
    routes = [
        RouteLaw(
            f"a{i}",
            base=rng.uniform(0.45, 0.75),
            cycle=rng.uniform(0.0, 0.3),
            phase_h=_phase(rng),
            step_minutes=rng.choice((15, 30, 60)),
            step=rng.uniform(0.2, 0.4),
            noise=0.01,
            skew=rng.uniform(-0.05, 0.05),
        )
        for i in range(count)
    ]
    # One cheap route that may fall back to a provider without price caps: never payable.
    routes[0] = RouteLaw(
        "a0", base=0.3, step_minutes=60, step=0.3, noise=0.01,
        fallback=RouteLaw("a0-fallback", base=0.3, caps=False),
    )  # fmt: skip
    return Family(
        "auction",
        "prices re-drawn every 15-60 minutes per route; one cheap route with an uncapped fallback",
        tuple(routes),
        (20, 45, 65),
        common=0.1,
        common_half_life_h=4.0,
    )


def operator(rng: random.Random) -> Family:
    routes = tuple(
        RouteLaw(
            f"o{i}",
            base=rng.uniform(0.15, 0.4),
            cycle=rng.uniform(0.3, 0.6),
            phase_h=_phase(rng),
            wander=0.1,
            wander_half_life_h=1.0,
            noise=rng.uniform(0.04, 0.1),
            noise_df=4.0,
            dip_every_h=rng.uniform(4, 10),
            dip_minutes=rng.uniform(5, 20),
            dip_factor=(0.15, 0.5),
            skew=rng.uniform(-0.03, 0.03),
        )
        for i in range(3)
    )
    return Family(
        "operator",
        "three routes: own levels, daily cycles, heavy-tailed noise, dips; minima 50-90%",
        routes,
        (50, 70, 80, 90),
    )


FAMILIES: dict[str, Callable[[random.Random], Family]] = {
    "reverting": reverting,
    "diurnal": diurnal,
    "dips": dips,
    "cycle+noise": cycle_noise,
    "regimes": regimes,
    "stale-feed": stale_feed,
    "auction": auction,
    "operator": operator,
}

#: What the policy's defaults were chosen on: these families, these seeds. (Dips are
#: cheap to run and where a deadline is most at risk, so they get more seeds: the
#: ``spare`` chances a wait needs were set on them.)
TRAIN: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("reverting", (1, 2, 3)),
    ("diurnal", (1, 2, 3)),
    ("dips", (1, 2, 3, 4, 5, 6, 7, 8, 9)),
    ("cycle+noise", (1, 2)),
)
#: What it is judged on: families it never saw, and unseen seeds of the others.
HELD_OUT: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("regimes", (101, 102)),
    ("stale-feed", (101, 102)),
    ("auction", (101, 102)),
    ("operator", (101, 102)),
    ("reverting", (101,)),
    ("diurnal", (101,)),
    ("dips", (101,)),
    ("cycle+noise", (101,)),
)


def family(name: str, seed: int) -> Family:
    return FAMILIES[name](random.Random(f"{name}/{seed}"))
