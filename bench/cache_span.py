"""What a wider span of used cache cells costs one ``llama_decode``, on llama.cpp directly.

The embedded scheduler keeps one unified KV cache for every sequence. llama.cpp's
attention runs over every cell up to the highest one in use (``used_max_p1``, padded
to 256), masked cells included, whichever sequence they belong to: idle prefixes
that nobody reads again still widen what every step of every sequence attends over.
This bench measures that cost, so the scheduler's idle-prefix rules rest on numbers:
one context per setting, each holding a 114-token prefix (decide's shared opening)
and N cells of other sequences; the same chunk decoded after the prefix in each,
the settings alternated in rounds (these machines are noisy) and the median printed
beside the no-filler baseline of the same run.

    python bench/cache_span.py [--tokens 69] [--rounds 12]
"""

from __future__ import annotations

import argparse
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

PREFIX = 114
FILLERS = (0, 1000, 3000, 6000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=69, help="tokens decoded a step (1: generation)")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()

    import llama_cpp

    @llama_cpp.llama_log_callback
    def quiet(_level: int, _text: bytes, _user: Any) -> None:
        """llama.cpp's own lines (buffer sizes) would bury the table."""

    llama_cpp.llama_log_set(quiet, None)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(
        str(default_model_path()).encode(), llama_cpp.llama_model_default_params()
    )
    batch = llama_cpp.llama_batch_init(640, 0, 8)

    def context() -> Any:
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 8192, 640, 512, 16
        p.n_threads = p.n_threads_batch = 2
        p.kv_unified = True
        p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.no_perf = True
        return llama_cpp.llama_init_from_model(model, p)

    def decode(ctx: Any, tokens: list[int], pos0: int, seq: int) -> float:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos0 + i, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = i == len(tokens) - 1
        started = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return time.perf_counter() - started

    rng = random.Random(0)
    tokens = [rng.randrange(100, 40000) for _ in range(1200)]
    settings: list[tuple[int, Any, list[float]]] = []
    for filler in FILLERS:
        ctx = context()
        for k in range(filler // 500):
            decode(ctx, tokens[:500], 0, 2 + k)
        decode(ctx, tokens[:PREFIX], 0, 0)
        settings.append((filler, ctx, []))
    chunk = tokens[1000 : 1000 + args.tokens]
    for r in range(args.rounds):
        for _, ctx, times in settings if r % 2 == 0 else settings[::-1]:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, PREFIX, -1)
            times.append(decode(ctx, chunk, PREFIX, 0))
    base = statistics.median(settings[0][2])
    print(f"{args.tokens}-token decode after a {PREFIX}-token prefix, median of {args.rounds}:")
    for filler, ctx, times in settings:
        med = statistics.median(times)
        print(f"  +{filler:>5} cells of other sequences: {med * 1000:6.1f} ms  ({med / base:.2f}×)")
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_batch_free(batch)


if __name__ == "__main__":
    main()
