"""Each mechanism of the embedded scheduler, on and off, in one process, rounds alternating.

A mechanism stays only if it helps at least one workload beyond the noise and
costs nothing measurable on the others (issue 36). Every switch is a field of
``engines.llama.cache.Tuning`` (and the shelf's size), flipped on the step
thread between two measurements of one engine: one process, one step thread,
so llama.cpp's OpenMP threads stay one team (two engines in one process would
make two teams and slow both). Each round measures, for every mechanism and
workload, the mechanism on and off (the order flips every round) on fresh
inputs of the same kind, so neither setting reads the other's cached prompts.

Workloads, in-process (no HTTP):

- ``chat1``: one client, lone chats (32 tokens) on the bench's prompts, output tokens/s;
- ``chat8``: eight clients, a burst of eight short chats (4 tokens, 8 without
  ``--quick``), output tokens/s;
- ``decide``: four clients, texts/s, each text one scoring call with every
  outcome of both decisions of ``bench/engine.py`` (its prompt as
  ``core.decisions.build_messages`` lays it out, the text last).

Printed per mechanism and workload: the geometric mean of on / off over the
rounds and its 95 % interval (t over the log ratios). An interval that excludes
1.0 is a measured effect.

    python bench/mechanisms.py [--rounds N] [--threads N] [--only shelve,shelf_dup]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench.engine import DECISIONS, chat_pool, review_pool

from batchyard.core import decisions as rules
from batchyard.engines.llama.cache import SHELF_BYTES
from batchyard.engines.llama_cpp import LlamaCppEngine
from batchyard.engines.model_files import default_model_path
from batchyard.engines.protocol import CompletionRequest

#: Each mechanism: the Tuning field (or "shelf") and its value on and off.
MECHANISMS: dict[str, tuple[str, Any, Any]] = {
    "shelve": ("shelve", True, False),
    "shelf_dup": ("shelf_dup", 16, 1),
    "score_with_prompt": ("score_with_prompt", True, False),
    "shelf": ("shelf", SHELF_BYTES, 0),
}

#: 95 % two-sided t quantiles by degrees of freedom.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


class Inputs:
    """Fresh chat prompts and decide texts, none twice while the pools last."""

    def __init__(self, seed: int) -> None:
        self.chats = chat_pool()
        self.texts = review_pool()
        rng = random.Random(seed)
        rng.shuffle(self.chats)
        rng.shuffle(self.texts)

    def take_chats(self, n: int) -> list[str]:
        out, self.chats = self.chats[:n], self.chats[n:] + self.chats[:n]
        return out

    def take_texts(self, n: int) -> list[str]:
        out, self.texts = self.texts[:n], self.texts[n:] + self.texts[:n]
        return out


def decide_call(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    req = rules.parse_request({"model": "smollm2", "input": {"text": text}, "decisions": DECISIONS})
    messages = rules.build_messages(req, "lines")
    candidates = [c for group in rules.scoring_candidates(req.decisions) for c in group]
    return messages, candidates


async def clients(n: int, work: list[Callable[[], Awaitable[float]]]) -> float:
    """Run ``work`` with ``n`` concurrent clients; the units done per second."""
    queue = list(work)
    units = 0.0

    async def client() -> None:
        nonlocal units
        while queue:
            job = queue.pop()
            units += await job()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(n)))
    return units / (time.perf_counter() - started)


async def chat_load(eng: LlamaCppEngine, prompts: list[str], n: int, tokens: int) -> float:
    def one(p: str) -> Callable[[], Awaitable[float]]:
        async def call() -> float:
            msgs = [{"role": "user", "content": p}]
            done = await eng.complete(
                CompletionRequest("smollm2", msgs, tokens, temperature=0.0)  # type: ignore[arg-type]
            )
            return float(done.usage.output_tokens)

        return call

    return await clients(n, [one(p) for p in prompts])


async def decide_load(eng: LlamaCppEngine, texts: list[str], n: int) -> float:
    def one(text: str) -> Callable[[], Awaitable[float]]:
        async def call() -> float:
            messages, candidates = decide_call(text)
            await eng.score("smollm2", messages, candidates)
            return 1.0

        return call

    return await clients(n, [one(t) for t in texts])


async def measure(eng: LlamaCppEngine, workload: str, inputs: Inputs, quick: bool) -> float:
    k = 1 if quick else 2
    if workload == "chat1":
        return await chat_load(eng, inputs.take_chats(2 * k), 1, 32)
    if workload == "chat8":
        return await chat_load(eng, inputs.take_chats(8 * k), 8, 4 * k)
    return await decide_load(eng, inputs.take_texts(8 * k), 4)


async def switch(eng: LlamaCppEngine, field: str, value: Any) -> None:
    model = eng._states[None].model
    assert model is not None
    scheduler = model.steps.scheduler

    def flip() -> None:
        if field == "shelf":
            scheduler.cache.shelf_bytes = value
            if not value:
                scheduler.cache.shelf.clear()
        else:
            setattr(scheduler.tuning, field, value)

    await model.steps.call(flip)


def interval(ratios: list[float]) -> tuple[float, float, float]:
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = T95.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="comma-separated mechanisms")
    ap.add_argument("--workloads", default="chat1,chat8,decide")
    ap.add_argument("--quick", action="store_true", help="half the requests a measurement")
    args = ap.parse_args()
    names = [m for m in args.only.split(",") if m] or list(MECHANISMS)
    workloads = args.workloads.split(",")
    eng = LlamaCppEngine(default_model_path(), n_ctx=2048, slots=8, n_threads=args.threads)
    await eng.load()
    inputs = Inputs(7)
    ratios: dict[tuple[str, str], list[float]] = {(m, w): [] for m in names for w in workloads}
    try:
        for w in workloads:  # warm every path once
            await measure(eng, w, inputs, quick=True)
        for r in range(args.rounds):
            for m in names:
                field, on, off = MECHANISMS[m]
                for w in workloads:
                    got: dict[str, float] = {}
                    order = [("on", on), ("off", off)]
                    if r % 2:
                        order.reverse()
                    for label, value in order:
                        await switch(eng, field, value)
                        got[label] = await measure(eng, w, inputs, args.quick)
                    await switch(eng, field, on)
                    ratios[(m, w)].append(got["on"] / got["off"])
                    print(
                        f"round {r + 1} {m:20} {w:7} on {got['on']:7.2f} off {got['off']:7.2f}"
                        f"  on/off {got['on'] / got['off']:.3f}",
                        flush=True,
                    )
    finally:
        await eng.aclose()
    print(f"\n{args.rounds} rounds, {args.threads} threads; on/off, geometric mean [95 % interval]")
    for m in names:
        cells = []
        for w in workloads:
            mean, lo, hi = interval(ratios[(m, w)])
            mark = "*" if lo > 1.0 or hi < 1.0 else " "
            cells.append(f"{w} {mean:.3f} [{lo:.3f}, {hi:.3f}]{mark}")
        print(f"{m:20} " + "   ".join(cells))


if __name__ == "__main__":
    asyncio.run(main())
