"""What reading short embedding inputs together buys, and what it costs in the vectors.

The embedded engine's embeddings read consecutive inputs in one decode while the
decode stays under 64 rows (``embedding_packs``), with flash attention on. This
bench runs, in one process and on one model, the same review texts through two
embedding contexts, alternated in rounds (these machines are noisy): ``packed`` as
the engine ships it, and ``alone`` as it was before (one decode an input, flash
attention off). It prints each round's inputs/s, the medians with their ratio, and
how far a packed vector lies from the same input's vector read alone.

    python bench/embed_packing.py [--rounds 8] [--inputs 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "bench")]

from engine import review_texts  # noqa: E402

import batchyard.engines  # noqa: E402,F401  (sets OpenMP's waiting before llama_cpp loads)
from batchyard.engines.llama.models import embedding_packs  # noqa: E402
from batchyard.engines.model_files import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--inputs", type=int, default=32)
    args = ap.parse_args()

    import llama_cpp

    def context(flash: bool) -> Any:
        return llama_cpp.Llama(
            str(default_model_path()),
            n_ctx=2048,
            n_batch=2048,
            n_ubatch=2048,
            n_threads=len(os.sched_getaffinity(0)),
            embedding=True,
            pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            flash_attn=flash,
            verbose=False,
        )

    packed_ctx, flash_alone = context(True), context(True)
    alone_ctx = context(False)

    def packed(texts: list[str], counts: list[int]) -> list[Any]:
        out: list[Any] = [None] * len(texts)
        for pack in embedding_packs(counts):
            got = packed_ctx.embed([texts[i] for i in pack], normalize=True)
            for i, vector in zip(pack, got, strict=True):
                out[i] = vector
        return out

    def alone(texts: list[str], _counts: list[int]) -> list[Any]:
        return [alone_ctx.embed(t, normalize=True) for t in texts]

    rates: dict[str, list[float]] = {"packed": [], "alone": []}
    worst = 0.0
    for r in range(args.rounds):
        texts = review_texts(100 + r, args.inputs)
        counts = [len(packed_ctx.tokenize(t.encode("utf-8"), True, False)) for t in texts]
        order = (("packed", packed), ("alone", alone))
        for name, run in order if r % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            got = run(texts, counts)
            rates[name].append(len(texts) / (time.perf_counter() - started))
            if name == "packed":
                for text, vector in zip(texts, got, strict=True):
                    one = flash_alone.embed(text, normalize=True)
                    worst = max(worst, max(abs(a - b) for a, b in zip(vector, one, strict=True)))
        print(
            f"round {r + 1}: packed {rates['packed'][-1]:5.1f} inputs/s, "
            f"alone {rates['alone'][-1]:5.1f}",
            flush=True,
        )
    p, a = statistics.median(rates["packed"]), statistics.median(rates["alone"])
    print(
        f"{args.inputs} review texts, median of {args.rounds} rounds: packed {p:.1f} inputs/s, "
        f"alone {a:.1f}: {p / a:.2f}×; a packed vector lies within {worst:.1e} of the "
        "same input read alone (flash attention on)"
    )


if __name__ == "__main__":
    main()
