"""Why a temperature-0 answer can differ beside other requests: llama.cpp's CPU attention, probed.

The embedded engine decodes many sequences in one unified KV cache with flash
attention on (``engines/llama/native.py``). This script drives llama.cpp
directly, through llama-cpp-python's low-level bindings and the same GGUF,
and changes one thing at a time, comparing a sequence's logits bit for bit:

1. **What else is in its step, while it decodes.** One sequence decoded alone
   (one row a step) against the same sequence beside seven others (eight
   rows a step), and alone with a throwaway second row.
2. **How many rows its prompt was read with.** The eight prompts read in one
   batch (one micro-batch of 64 rows or more) against each prompt alone
   (under 64 rows), then both again with micro-batches under 64 rows
   (``n_ubatch`` 63).
3. **Where its cells sit.** The same sequence with its cells in position
   order, and with another sequence's cells freed below it first, so that
   its new tokens land in that hole, below its earlier cells.

What it showed (SmolLM2-135M Q4_1, llama-cpp-python 0.3.36, 2 threads):

- 1: identical, bit for bit: the decode kernels do not depend on the other
  rows (the ``Q8_0`` output matrix goes through llamafile's ``sgemm`` for two
  rows or more and through ``ggml_vec_dot`` for one, with the same sums);
- 2: different from the first generated token (up to 0.83 in a logit), and
  the greedy answers part at the sixth token. ggml-cpu's flash attention
  takes a tiled kernel for a micro-batch of ``GGML_FA_TILE_Q`` (64) rows or
  more and a row-by-row one below, and they round differently. With
  ``n_ubatch`` 63 (and a lone decoded row padded to two, so it never takes
  the split-KV kernel of one row over 512 cells) they are identical;
- 3: different from the first step with flash attention (0.91): the
  row-by-row kernel sums a sequence's cells in the order they sit in the
  cache, not in position order, and the greedy answers part at the third
  token; without flash attention the first eleven steps match, then the
  logits part too.

So no context setting makes the embedded engine batch-invariant:
micro-batches under 64 rows remove cause 2 (for about a fifth of the prompt
reading speed: ``llama-batched-bench -ub 63`` read 230-247 tokens/s where
``-ub 512`` read 278-308), but where a sequence's new cells land in the one
shared cache is llama.cpp's allocator's choice (it fills the holes finished
sequences leave), and the engine's scheduler with both changes still gave 5
of 8 identical answers. ``llama-server`` gives 8 of 8 (``-np 8``, flash
attention on, ``cache_prompt`` off): each slot has a KV stream of its own, so
a prompt is attended row by row within its own stream and a slot's cells are
only its own, in order; the price is that no cell is shared between slots.
See ``docs/explanation/batch-invariance.md``.

    python bench/batch_invariance.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from batchyard.engines.model_files import default_model_path  # noqa: E402

QUESTIONS = [
    "Explain gravity to a child.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three fruits.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Describe the ocean in one sentence.",
    "Give me a tip for learning Python.",
]
STEPS = 40
FILLER_SEQ, SCRATCH_SEQ = 15, 14


class Probe:
    """A llama context of its own per run, driven token by token."""

    def __init__(self) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(
            str(default_model_path()).encode(), params
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.filler = self.tokens("The quick brown fox jumps over the lazy dog. " * 60)

    def tokens(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self.lib.llama_token * 4096)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, 4096, False, True)
        return list(buf[:n])

    def chat(self, question: str) -> list[int]:
        return self.tokens(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")

    def run(
        self,
        *,
        together: bool = False,
        read_together: bool = True,
        pad: bool = False,
        ubatch: int = 512,
        hole: bool = False,
        flash: bool = True,
        filler_first: int = 600,
    ) -> tuple[list[int], list[Any]]:
        """Greedy tokens and logits rows of sequence 0 (question 0) for ``STEPS`` steps."""
        lib = self.lib
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 8192, 2048, ubatch, 16
        cp.n_threads = cp.n_threads_batch = 2
        cp.kv_unified = True
        cp.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        ctx = lib.llama_init_from_model(self.model, cp)
        mem = lib.llama_get_memory(ctx)
        batch = lib.llama_batch_init(2048, 0, 1)

        def add(token: int, pos: int, seq: int, logits: bool) -> int:
            i = int(batch.n_tokens)
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
            batch.n_tokens = i + 1
            return i

        def decode() -> None:
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def row(i: int) -> Any:
            return np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, i), (self.n_vocab,))

        try:
            # Other work fills cells first (over 512 of them, as in a busy server);
            # with ``hole`` it leaves after the prompt is read, below its cells.
            batch.n_tokens = 0
            for j, t in enumerate(self.filler[: (60 if hole else filler_first)]):
                add(t, j, FILLER_SEQ, False)
            decode()
            seqs = list(range(8)) if together else [0]
            last_row: dict[int, int] = {}
            pos: dict[int, int] = {}
            nxt: dict[int, int] = {}
            batch.n_tokens = 0
            for s in seqs:  # prompts that arrive together are read in one batch
                prompt = self.chat(QUESTIONS[s])
                for j, t in enumerate(prompt):
                    last_row[s] = add(t, j, s, j == len(prompt) - 1)
                pos[s] = len(prompt)
                if not read_together:
                    decode()
                    nxt[s] = int(np.argmax(row(last_row[s])))
                    batch.n_tokens = 0
            if read_together:
                decode()
                nxt = {s: int(np.argmax(row(last_row[s]))) for s in seqs}
            if hole:
                lib.llama_memory_seq_rm(mem, FILLER_SEQ, -1, -1)
            tokens, rows = [nxt[0]], []
            for step in range(STEPS):
                batch.n_tokens = 0
                at = {s: add(nxt[s], pos[s], s, True) for s in seqs}
                if pad:
                    add(self.filler[step], 0, SCRATCH_SEQ, False)
                decode()
                if pad:
                    lib.llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1)
                for s in seqs:
                    r = row(at[s])
                    nxt[s], pos[s] = int(np.argmax(r)), pos[s] + 1
                    if s == 0:
                        tokens.append(nxt[s])
                        rows.append(r.copy())
            return tokens, rows
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)


def compare(name: str, a: Callable[[], Any], b: Callable[[], Any]) -> None:
    (ta, ra), (tb, rb) = a(), b()
    step = next((i for i in range(STEPS) if not np.array_equal(ra[i], rb[i])), None)
    part = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
    if step is None:
        print(f"{name}: identical logits for {STEPS} steps")
        return
    diff = float(np.abs(ra[step] - rb[step]).max())
    where = "never" if part is None else f"at token {part}"
    print(f"{name}: logits differ from step {step} (up to {diff:.2f} there); answers part {where}")


def main() -> None:
    from llama_cpp import _logger

    _logger.set_verbose(False)  # llama.cpp's own log lines, from every context made here
    probe = Probe()

    print("1. what else is in the step while a sequence decodes (each prompt read alone):")
    compare(
        "   alone vs beside seven others",
        lambda: probe.run(),
        lambda: probe.run(together=True, read_together=False),
    )
    compare(
        "   alone vs alone with a throwaway second row",
        lambda: probe.run(),
        lambda: probe.run(pad=True),
    )
    print("2. eight prompts read in one batch vs the prompt read alone, then decoding together:")
    compare(
        "   n_ubatch 512",
        lambda: probe.run(),
        lambda: probe.run(together=True),
    )
    compare(
        "   n_ubatch 63, lone steps padded",
        lambda: probe.run(ubatch=63, pad=True),
        lambda: probe.run(ubatch=63, together=True),
    )
    print("3. the sequence's cells in position order vs new cells in a hole below them:")
    compare(
        "   flash attention on, n_ubatch 63",
        lambda: probe.run(ubatch=63, pad=True, filler_first=60),
        lambda: probe.run(ubatch=63, pad=True, hole=True),
    )
    compare(
        "   flash attention off, n_ubatch 63",
        lambda: probe.run(ubatch=63, pad=True, flash=False, filler_first=60),
        lambda: probe.run(ubatch=63, pad=True, hole=True, flash=False),
    )


if __name__ == "__main__":
    main()
