"""A LoRA version beside its base on the embedded engine: chat tokens/s under mixed traffic.

Issue 20 asks that a LoRA version cost no second copy of the base weights:
its requests are sequences of the base model's scheduler, and since llama.cpp
applies adapters to a whole context, each step serves one adapter's group
(turns of ``llama_scheduler.ADAPTER_TURN`` steps). This measures what that
costs and what the turn length buys, against the alternative it replaced (a
second model with a scheduler of its own, here the base GGUF loaded again as
a ``gguf`` version: the same compute without the adapter's small matmuls,
and a second copy of the weights).

Contenders, each on the same engine settings, in rounds (the order rotates
every round, so none always runs first or last on a busy machine):

- ``base-only``: 2N clients on the base, no version traffic (the ceiling);
- ``shared-turn-K``: N clients on the base and N on the LoRA version at once,
  groups taking turns of K steps (K from ``--turns``);
- ``own-model``: N clients on the base and N on a second copy of the model,
  each model's scheduler with the same ``--threads`` (so twice the threads);
- ``own-model-split``: the same with half the threads each (the same total).

Each client sends chat completions (``max_tokens`` tokens, temperature 0.8,
a fresh prompt each time so no answer is cached) for ``--seconds`` seconds;
the output is each contender's output tokens/s for base and version clients
and their sum, per round and as the median over rounds, output tokens per
CPU-second of the process (the measure a busy, shared machine distorts
least: more threads take a larger share of contended cores, which tokens/s
alone would credit to the design), and the resident memory (``VmRSS``)
after each contender.

    .venv/bin/python bench/lora_mix.py [--clients 2] [--seconds 20] [--rounds 2] [--turns 1,4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

from batchyard.engines.llama import scheduler as llama_scheduler
from batchyard.engines.llama_cpp import LlamaCppEngine, VersionSpec
from batchyard.engines.model_files import default_model_path
from batchyard.engines.protocol import CompletionRequest

ADAPTER = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2-sentiment-lora.gguf"
WORDS = [
    "parcel",
    "strap",
    "colour",
    "screen",
    "update",
    "battery",
    "refund",
    "delivery",
    "charger",
    "box",
    "manual",
]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _client(
    engine: LlamaCppEngine, model: str, until: float, max_tokens: int, rng: random.Random
) -> int:
    tokens = 0
    while time.perf_counter() < until:
        text = " ".join(rng.choice(WORDS) for _ in range(12))
        request = CompletionRequest(
            model=model,
            messages=[{"role": "user", "content": f"Write about: {text}"}],
            max_tokens=max_tokens,
            temperature=0.8,
        )
        done = await engine.complete(request)
        tokens += done.usage.output_tokens
    return tokens


async def _measure(
    name: str, clients: int, seconds: float, max_tokens: int, threads: int, seed: int
) -> dict[str, Any]:
    path = default_model_path()
    versions = {"lora": VersionSpec("lora", ADAPTER), "copy": VersionSpec("gguf", path)}
    if name == "own-model-split":
        threads = max(1, threads // 2)
    engine = LlamaCppEngine(
        path, slots=2 * clients, n_ctx=512, n_threads=threads, versions=versions
    )
    other = {"base-only": None, "own-model": "copy", "own-model-split": "copy"}.get(name, "lora")
    if name.startswith("shared-turn-"):
        llama_scheduler.ADAPTER_TURN = int(name.rsplit("-", 1)[1])
    try:
        await engine.load()
        if other is not None:
            await engine.load_version(other)
        rng = random.Random(seed)
        until = time.perf_counter() + seconds
        started = time.perf_counter()
        cpu = time.process_time()
        base = [_client(engine, "base", until, max_tokens, rng) for _ in range(clients)]
        side = [_client(engine, other or "base", until, max_tokens, rng) for _ in range(clients)]
        counts = await asyncio.gather(*base, *side)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        rss = _rss_mb()
    finally:
        await engine.aclose()
    base_tps = sum(counts[:clients]) / elapsed
    side_tps = sum(counts[clients:]) / elapsed
    total = base_tps + side_tps
    return {
        "base": base_tps,
        "version": side_tps,
        "total": total,
        "per_cpu_s": total * elapsed / cpu,
        "rss_mb": rss,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=2, help="clients per group")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turns", default="1,4")
    args = parser.parse_args()
    names = [
        "base-only",
        *(f"shared-turn-{k}" for k in args.turns.split(",")),
        "own-model",
        "own-model-split",
    ]
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            got = await _measure(
                name, args.clients, args.seconds, args.max_tokens, args.threads, seed=r
            )
            results[name].append(got)
            print(
                f"round {r + 1} {name:16} base {got['base']:6.1f} tok/s  version "
                f"{got['version']:6.1f} tok/s  total {got['total']:6.1f}  "
                f"per CPU-s {got['per_cpu_s']:5.1f}  rss {got['rss_mb']:.0f} MB",
                flush=True,
            )
    ceiling = statistics.median(x["total"] for x in results["base-only"])
    per_cpu = statistics.median(x["per_cpu_s"] for x in results["base-only"])
    print("\nmedians (ratios to base-only):")
    for name in names:
        rows = results[name]
        total = statistics.median(x["total"] for x in rows)
        eff = statistics.median(x["per_cpu_s"] for x in rows)
        print(
            f"{name:16} base {statistics.median(x['base'] for x in rows):6.1f}  version "
            f"{statistics.median(x['version'] for x in rows):6.1f}  total {total:6.1f} "
            f"({total / ceiling:.2f})  per CPU-s {eff:5.1f} ({eff / per_cpu:.2f})  "
            f"rss {statistics.median(x['rss_mb'] for x in rows):.0f} MB"
        )


if __name__ == "__main__":
    asyncio.run(main())
