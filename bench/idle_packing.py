"""What packing the idle prefixes after a burst buys the next lone request.

When a burst of requests ends, the embedded scheduler moves the prompts it keeps
for reuse (idle prefixes) to the lowest cells of its unified cache
(``Scheduler._compact``): every step attends over every cell up to the highest
one in use, and a burst leaves those prompts wherever it placed them. This bench
runs, in one process and on one model, the same work two ways, alternated in
rounds (these machines are noisy): a burst of concurrent chats, then lone chats
one after another, timed. ``packed`` is the scheduler as it ships; ``spread``
is the same scheduler with packing turned off for the round. It prints each
round and the median output tokens per second of the lone chats, with their ratio.

    python bench/idle_packing.py [--rounds 6] [--burst 16] [--lone 4]
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

from engine import chat_prompts  # noqa: E402

import batchyard.engines  # noqa: E402,F401  (sets OpenMP's waiting before llama_cpp loads)
from batchyard.engines.llama_cpp import LlamaCppEngine  # noqa: E402
from batchyard.engines.model_files import default_model_path  # noqa: E402
from batchyard.engines.protocol import CompletionRequest  # noqa: E402


def ask(prompt: str, max_tokens: int) -> CompletionRequest:
    messages = [{"role": "user", "content": prompt}]
    return CompletionRequest("smollm2", messages, max_tokens, temperature=0.0)


async def run(args: argparse.Namespace) -> None:
    engine = LlamaCppEngine(default_model_path(), slots=8)
    await engine.load()
    scheduler = engine._slots[None].model.scheduler  # type: ignore[union-attr]
    packs = scheduler._spread
    rates: dict[str, list[float]] = {"packed": [], "spread": []}
    try:
        for r in range(args.rounds):
            order = ("packed", "spread") if r % 2 == 0 else ("spread", "packed")
            for k, how in enumerate(order):
                scheduler._spread = packs if how == "packed" else (lambda: False)
                seed = 1000 * r + k
                burst = chat_prompts(seed, args.burst)
                await asyncio.gather(*(engine.complete(ask(p, 64)) for p in burst))
                started, tokens = time.perf_counter(), 0
                for prompt in chat_prompts(seed + 500, args.lone):
                    done = await engine.complete(ask(prompt, 64))
                    tokens += done.usage.output_tokens
                rates[how].append(tokens / (time.perf_counter() - started))
                print(f"round {r + 1} {how:>6}: {rates[how][-1]:6.1f} tok/s", flush=True)
    finally:
        scheduler._spread = packs
        await engine.aclose()
    packed, spread = (statistics.median(rates[h]) for h in ("packed", "spread"))
    print(
        f"lone chats after a burst of {args.burst}, median of {args.rounds} rounds: "
        f"packed {packed:.1f} tok/s, spread {spread:.1f} tok/s, {packed / spread:.2f}×"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--burst", type=int, default=16, help="concurrent chats before the lone ones")
    ap.add_argument("--lone", type=int, default=4, help="lone chats timed after each burst")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
