"""How close does waiting for a price come to the optimal stopping of each item?

    .venv/bin/python -m bench.market                 # the held-out table (the verdict)
    .venv/bin/python -m bench.market --set train     # what the defaults were chosen on
    .venv/bin/python -m bench.market --quick         # one seed per held-out family, fewer items

For each family and seed it draws five days of prices (a check every 15 s),
lets the worker watch three of them, submits a day of items in bursts of 1-50
(windows of 1, 6 or 24 hours, each family's own minimum discounts), replays
the worker (at most ten dispatches a pass) with every contender, and prints
per family and overall:

* paid / hindsight: total paid over the total of the cheapest qualifying cost
  each item's window held, over the items dispatched;
* paid / reference: total paid over what the *reference* paid for the same
  items: each item's optimal-stopping problem solved on the family's own law
  from the market's present state (never its future) by least-squares Monte
  Carlo at every check, under the same ten dispatches a pass, see
  ``bench/market/reference.py``;
* deadlines met, out of the items whose window held a qualifying price, and
  in red how many of those first-eligible met that the contender missed.

``deadline-aware`` has the three warm-up days saved; ``deadline-aware, 1 day``
only the last of them; ``deadline-aware, cold`` is a worker started at the
measured day's dawn with nothing saved; ``deadline-aware, true law`` is the
same policy handed the family's law instead of its history (what knowing the
law is worth; the rest of its gap is how it solves the stopping problem).
The families and seeds the policy was tuned on (TRAIN) and
those it is judged on (HELD_OUT) are listed in ``bench/market/laws.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from bench.market.laws import HELD_OUT, TRAIN
from bench.market.run import ONLINE, Result, run_family
from rich.console import Console
from rich.table import Table

Row = tuple[float, float, int, int, int]  # paid/hindsight, paid/reference, met, chances, lost

FIRST = "first-eligible"


def score(results: Sequence[Result], contender: str) -> Row:
    """Totals over every seed of a family, for one contender.

    ``lost`` counts deadlines first-eligible met and this contender missed.
    """
    paid = hind = paid_common = online = 0.0
    met = chances = lost = 0
    for r in results:
        mine, best = r.paid.get(contender, {}), r.paid.get(ONLINE, {})
        first = r.paid.get(FIRST, {})
        for sim in r.items:
            if sim.best is None:
                continue
            chances += 1
            if sim.item.id not in mine:
                lost += sim.item.id in first
                continue
            met += 1
            paid += mine[sim.item.id]
            hind += sim.best
            if sim.item.id in best:
                paid_common += mine[sim.item.id]
                online += best[sim.item.id]
    return (
        paid / hind if hind else float("nan"),
        paid_common / online if online else float("nan"),
        met,
        chances,
        lost,
    )


def _lost(count: int) -> str:
    """Deadlines first-eligible met that this contender missed, if any."""
    return f" [red]-{count}[/]" if count else ""


def _run(job: tuple[str, int, int]) -> Result:
    return run_family(*job)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--set", choices=("held-out", "train"), default="held-out")
    parser.add_argument("--quick", action="store_true", help="one seed a family, 120 items")
    parser.add_argument("--items", type=int, default=None, help="items per family and seed")
    parser.add_argument("--family", action="append", help="only these families")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)

    chosen = HELD_OUT if args.set == "held-out" else TRAIN
    count = args.items or (120 if args.quick else 200)
    jobs = [
        (name, seed, count)
        for name, seeds in chosen
        if not args.family or name in args.family
        for seed in (seeds[:1] if args.quick else seeds)
    ]
    console = Console(width=160)
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_run, jobs))
    by_family: dict[str, list[Result]] = {}
    for r in results:
        by_family.setdefault(r.family, []).append(r)
    names: list[str] = []
    for r in results:
        names += [n for n in r.paid if n not in names]

    table = Table(
        title=f"{args.set} set: paid / hindsight, paid / reference, deadlines met",
        title_justify="left",
    )
    table.add_column("family (seeds)")
    for name in names:
        table.add_column(name, justify="right")
    overall: dict[str, list[Row]] = {name: [] for name in names}
    for fam, rs in by_family.items():
        cells = []
        for name in names:
            row = score(rs, name) if all(name in r.paid for r in rs) else None
            if row is None:
                cells.append("")
                continue
            overall[name].append(row)
            cells.append(f"{row[0]:.2f}  {row[1]:.3f}  {row[2]}/{row[3]}{_lost(row[4])}")
        seeds = ",".join(str(r.seed) for r in rs)
        table.add_row(f"{fam} ({seeds})", *cells)
    cells = []
    for name in names:
        rows = overall[name]
        if not rows:
            cells.append("")
            continue
        hind = statistics.fmean(r[0] for r in rows)
        online = statistics.fmean(r[1] for r in rows)
        worst = max(r[1] for r in rows)
        met, chances = sum(r[2] for r in rows), sum(r[3] for r in rows)
        lost = sum(r[4] for r in rows)
        cells.append(f"{hind:.2f}  {online:.3f} (worst {worst:.3f})  {met}/{chances}{_lost(lost)}")
    table.add_row("mean over families", *cells, style="bold")
    console.print(table)
    elapsed = time.perf_counter() - started
    cpu = {n: sum(r.seconds.get(n, 0.0) for r in results) for n in names}
    console.print(
        f"{len(jobs)} markets x {count} items, {elapsed:.0f} s wall on {args.jobs} processes; "
        + ", ".join(f"{n} {s:.0f} s" for n, s in cpu.items())
    )


if __name__ == "__main__":
    main()
