"""What a worker pass over 10,000 waiting items costs the policy: today's against this tree's.

    .venv/bin/python -m bench.market.hot [--items 10000] [--rounds 9] [--today 636d15b]

Today's is ``DeadlineAware`` as the commit ``--today`` has it (its market,
outlook and stopping modules loaded from git beside this tree's). Each is
restored with the same three days of a training family's prices. At each of
``rounds`` checks of the measured day, every contender (in turn, the order
alternating) is asked about every one of ``items`` waiting items, most urgent
first, as ``deferred_batch_worker`` asks them. Every one is asked: the worker
stops at ten chosen, so this is its slowest pass, one where nearly all wait.
Each is timed at the first check of a planning interval (the pass that
solves the plans) and at the next check (plans shared, only the per-item
work). The table gives each contender's median CPU seconds per pass (the
process's own time: other load on the machine does not count) and the
median of its ratios to today's in the same rounds.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import cast

from bench.market.laws import family
from bench.market.sim import DAWN, DIRECT, WARMUP_DAYS, WINDOWS, Market
from bench.market.trace import PER_DAY, PER_HOUR, Trace, time_of
from rich.console import Console
from rich.table import Table

from batchyard.core.market import DeadlineAware, Item, Policy


def today(ref: str) -> Callable[[], Policy]:
    """``DeadlineAware`` as the commit ``ref`` has it: its own market, outlook and stopping."""
    root = Path(tempfile.mkdtemp(prefix="market-today-")) / "_today"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name in ("stopping", "outlook", "market"):
        text = subprocess.run(
            ["git", "show", f"{ref}:src/batchyard/core/{name}.py"],
            check=True, capture_output=True, text=True, cwd=Path(__file__).parent,
        ).stdout  # fmt: skip
        for own in ("stopping", "outlook"):
            text = text.replace(f"from batchyard.core.{own} import", f"from _today.{own} import")
        (root / f"{name}.py").write_text(text)
    sys.path.insert(0, str(root.parent))
    module = importlib.import_module("_today.market")
    return cast("Callable[[], Policy]", module.DeadlineAware)


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
    started = time.process_time()
    for item in items:
        policy.choose(item, offers, DIRECT, now)
    return time.process_time() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--family", default="diurnal")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--today", default="636d15b", help="the commit whose policy is today's (before issue 39)"
    )
    args = parser.parse_args(argv)
    contenders: dict[str, Callable[[], Policy]] = {
        f"today ({args.today})": today(args.today),
        "deadline-aware": DeadlineAware,
    }
    fam = family(args.family, args.seed)
    market = Market(Trace(fam, args.seed, WARMUP_DAYS + 2))
    saved = market.history(DAWN, since=0)
    policies = {}
    for name, make in contenders.items():
        policy = make()
        policy.restore(saved)  # type: ignore[attr-defined]
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
                policy.observe(market.offers(k), DIRECT, time_of(k))  # type: ignore[attr-defined]
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
