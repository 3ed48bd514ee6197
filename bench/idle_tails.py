"""What moving idle prompts to the shelf buys the requests that follow.

A finished request's prompt stays in the embedded scheduler's unified cache for
reuse (an idle prefix), and every step of every request attends over every idle
cell. So when a request is admitted, the scheduler moves what it and the live
requests do not share of the idle prompts to host memory (the shelf,
``Scheduler._shelve``) and copies a shelved prompt back when a request starts
like it. This bench runs, in one process and on one model, lone requests one
after another two ways, alternated in rounds (these machines are noisy):
``shelved`` is the scheduler as it ships; ``kept`` keeps every idle prompt
whole in the cache (one a slot, the least recently used out first). Each way
first runs untimed requests so the cache holds what that way keeps, then times
the next ones. Two workloads:

- ``unique``: ~230-token prompts that share only the chat template's opening
  (``bench/workloads/summaries/prompts.txt``: summarise four support tickets);
- ``system``: a ~170-token system prompt shared by every request, then a short
  question (``bench/workloads/support``).

It prints each round and the median output tokens per second, with the ratio.

    python bench/idle_tails.py [--rounds 4] [--requests 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

from engine import Workload, read_lines, read_text  # noqa: E402

import batchyard.engines  # noqa: E402,F401  (sets OpenMP's waiting before llama_cpp loads)
from batchyard.engines.llama_cpp import LlamaCppEngine  # noqa: E402
from batchyard.engines.model_files import default_model_path  # noqa: E402
from batchyard.engines.protocol import CompletionRequest  # noqa: E402

WORKLOADS = ROOT / "bench" / "workloads"


def workloads() -> dict[str, Workload]:
    support = WORKLOADS / "support"
    return {
        "unique": Workload(read_lines(WORKLOADS / "summaries" / "prompts.txt", "chat")),
        "system": Workload(
            read_lines(support / "prompts.txt", "chat"),
            system=read_text(support / "system.txt", "system").strip(),
        ),
    }


async def lone(engine: LlamaCppEngine, work: Workload, prompts: list[str]) -> float:
    started, tokens = time.perf_counter(), 0
    for prompt in prompts:
        req = CompletionRequest("smollm2", work.messages(prompt), 64, temperature=0.0)
        tokens += (await engine.complete(req)).usage.output_tokens
    return tokens / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> None:
    engine = LlamaCppEngine(default_model_path(), slots=8)
    await engine.load()
    scheduler = engine._slots[None].model.scheduler  # type: ignore[union-attr]
    shelve, shelved_prefix = scheduler._shelve, scheduler._shelved_prefix
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for name, work in workloads().items():
                order = ("shelved", "kept") if r % 2 == 0 else ("kept", "shelved")
                for k, how in enumerate(order):
                    on = how == "shelved"
                    scheduler._shelve = shelve if on else (lambda _job: None)
                    scheduler._shelved_prefix = (
                        shelved_prefix if on else (lambda _job, have: (None, have))
                    )
                    drawn = work.chat_prompts(1000 * r + 10 * k, 2 * args.requests)
                    await lone(engine, work, drawn[: args.requests])  # the cache settles
                    rate = await lone(engine, work, drawn[args.requests :])
                    rates.setdefault((name, how), []).append(rate)
                    print(f"round {r + 1} {name:>6} {how:>7}: {rate:6.1f} tok/s", flush=True)
    finally:
        scheduler._shelve, scheduler._shelved_prefix = shelve, shelved_prefix
        await engine.aclose()
    for name in workloads():
        a, b = (statistics.median(rates[(name, h)]) for h in ("shelved", "kept"))
        print(
            f"{name}: lone chats, median of {args.rounds} rounds: "
            f"shelved {a:.1f} tok/s, kept {b:.1f} tok/s, {a / b:.2f}×"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=6, help="lone chats timed a way a round")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
