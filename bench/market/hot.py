"""What a worker pass over 10,000 waiting items costs the policy: today's rule vs the new one.

    .venv/bin/python -m bench.market.hot [--items 10000] [--rounds 5] [--family diurnal]

Each contender is a ``DeadlineAware`` restored with the same three days of a
training family's prices. At each of ``rounds`` checks of the measured day,
every contender (in turn, the order alternating) is asked about every one of
``items`` waiting items, most urgent first, as ``deferred_batch_worker`` asks
them; every one is asked (the worker stops at ten chosen, so this is its
slowest pass, one where nearly all wait): once at the first check of a planning interval
(the pass that solves the plans) and once at the next check (plans shared,
only the per-item work). The table gives each contender's median seconds per
pass and its ratio to today's rule in the same rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from decimal import Decimal

from bench.market.laws import family
from bench.market.sim import DAWN, DIRECT, WARMUP_DAYS, WINDOWS, Market
from bench.market.trace import PER_DAY, PER_HOUR, Trace, time_of
from rich.console import Console
from rich.table import Table

from batchyard.core.market import DeadlineAware, Item, Policy

#: Today's rule (a stop in a wide column charged half way to the threshold) and the new one.
CONTENDERS: dict[str, Callable[[], DeadlineAware]] = {
    "today (charge 0.5)": lambda: DeadlineAware(charge=0.5),
    "deadline-aware": DeadlineAware,
}


def _items(count: int, at: int, minima: Sequence[int], seed: int) -> list[Item]:
    rng = random.Random(seed)
    now = time_of(at)
    out = []
    for n in range(count):
        window = rng.choices([w for w, _ in WINDOWS], [p for _, p in WINDOWS])[0]
        submitted = now - rng.uniform(0, 0.9) * window
        out.append(
            Item(
                f"hot-{n}",
                Decimal(rng.choice(minima)),
                submitted + window,
                submitted,
                rng.randint(200, 4000),
                rng.choice((64, 256, 1024)),
            )
        )
    return sorted(out, key=lambda i: (i.deadline, i.id))


def _pass(policy: Policy, items: Sequence[Item], market: Market, check: int) -> float:
    offers, now = market.offers(check), time_of(check)
    started = time.perf_counter()
    for item in items:
        policy.choose(item, offers, DIRECT, now)
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--family", default="diurnal")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    fam = family(args.family, args.seed)
    market = Market(Trace(fam, args.seed, WARMUP_DAYS + 1))
    saved = market.history(DAWN, since=0)
    policies = {}
    for name, make in CONTENDERS.items():
        policy = make()
        policy.restore(saved)
        policies[name] = policy
    planning = 16  # checks per planning interval (DeadlineAware's default 4 minutes)
    timings: dict[str, dict[str, list[float]]] = {n: {"solve": [], "shared": []} for n in policies}
    for r in range(args.rounds):
        at = DAWN + (r * PER_DAY // args.rounds) // planning * planning + 2 * PER_HOUR
        items = _items(args.items, at, fam.minima, r)
        order = list(policies) if r % 2 == 0 else list(reversed(policies))
        for name in order:
            policy = policies[name]
            for k in range(at - 2, at):  # the checks before, as a worker watching saw them
                policy.observe(market.offers(k), DIRECT, time_of(k))
            timings[name]["solve"].append(_pass(policy, items, market, at))
            timings[name]["shared"].append(_pass(policy, items, market, at + 1))
    base = next(iter(policies))
    table = Table(title=f"a pass over {args.items} waiting items ({args.family} {args.seed})")
    for col in ("policy", "pass that solves", "ratio", "pass on shared plans", "ratio"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, got in timings.items():
        cells = []
        for kind in ("solve", "shared"):
            mine = statistics.median(got[kind])
            ratios = [a / b for a, b in zip(got[kind], timings[base][kind], strict=True)]
            cells += [f"{mine * 1000:.0f} ms", f"{statistics.median(ratios):.2f}"]
        table.add_row(name, *cells)
    Console(width=120).print(table)
    print(f"{args.rounds} rounds at their own checks; every waiting item asked")


if __name__ == "__main__":
    main()
