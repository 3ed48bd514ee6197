"""One unified KV cache against a KV stream a sequence, on llama.cpp directly.

The embedded scheduler's context is unified (``kv_unified``): sequences share one
pool of cells, so a prefix copy is free and a scoring trie's node sits in all its
tips, but every sequence's attention runs over every cell up to the highest one
in use, other sequences' included. ``llama-server`` gives each slot a stream of
its own, as ``kv_unified`` off does. This decodes the same work both ways: N
sequences, each a distinct prompt read in one batch, then a token of every
sequence a decode, the two contexts alternated in rounds, and prints generated
tokens/s and the ratio (unified / streams) per N.

    python bench/kv_streams.py [--sequences 1,4,8,16] [--prompt 64] [--tokens 32]
        [--rounds 4] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

import batchyard.engines  # noqa: E402,F401  (sets OpenMP's waiting before llama_cpp loads)
from batchyard.engines.model_files import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", default="1,4,8,16")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()

    import llama_cpp

    @llama_cpp.llama_log_callback
    def quiet(_level: int, _text: bytes, _user: Any) -> None:
        """llama.cpp's own lines would bury the table."""

    llama_cpp.llama_log_set(quiet, None)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(default_model_path()).encode(), llama_cpp.llama_model_default_params()
    )
    counts = [int(n) for n in args.sequences.split(",")]
    width = max(counts) * args.prompt
    batch = llama_cpp.llama_batch_init(width, 0, 1)
    per_seq = 2 * (args.prompt + args.tokens)

    def context(n: int, unified: bool) -> Any:
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_seq_max = max(256, 8 * n * per_seq), n
        p.n_batch, p.n_ubatch = width, min(width, 512)
        p.n_threads = p.n_threads_batch = args.threads
        p.kv_unified = unified
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.no_perf = True
        return llama_cpp.llama_init_from_model(model, p)

    rng = random.Random(0)

    def run(ctx: Any, n: int) -> float:
        """Read n prompts, then generate; seconds of generation decodes."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        k = 0
        for seq in range(n):
            for i in range(args.prompt):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = rng.randrange(100, 40000), i, 1
                batch.seq_id[k][0], batch.logits[k] = seq, i == args.prompt - 1
                k += 1
        batch.n_tokens = k
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed reading the prompts")
        spent = 0.0
        for step in range(args.tokens):
            batch.n_tokens = n
            for seq in range(n):
                batch.token[seq], batch.pos[seq] = rng.randrange(100, 40000), args.prompt + step
                batch.n_seq_id[seq], batch.seq_id[seq][0], batch.logits[seq] = 1, seq, True
            started = time.perf_counter()
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed generating")
            spent += time.perf_counter() - started
        return spent

    print(f"{args.threads} threads, {args.prompt}-token prompts, {args.tokens} tokens each:")
    for n in counts:
        contexts = {"unified": context(n, True), "streams": context(n, False)}
        times: dict[str, list[float]] = {"unified": [], "streams": []}
        for r in range(args.rounds):
            for name in ["unified", "streams"] if r % 2 == 0 else ["streams", "unified"]:
                times[name].append(run(contexts[name], n))
        rates = {k: n * args.tokens / statistics.median(v) for k, v in times.items()}
        ratios = sorted(s / u for u, s in zip(times["unified"], times["streams"], strict=True))
        ratio = rates["unified"] / rates["streams"]
        print(
            f"  {n:>2} sequences: unified {rates['unified']:7.1f} tok/s, streams "
            f"{rates['streams']:7.1f} tok/s, unified/streams {ratio:.3f}"
            f" (rounds {', '.join(f'{x:.2f}' for x in ratios)})",
            flush=True,
        )
        for ctx in contexts.values():
            llama_cpp.llama_free(ctx)
    llama_cpp.llama_batch_free(batch)


if __name__ == "__main__":
    main()
