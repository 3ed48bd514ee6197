"""``Context`` on a real llama.cpp context: the only place the scheduler's calls meet llama.cpp.

The context's KV cache is unified (``kv_unified``): every sequence draws cells
from one pool, so a sequence copy of a shared prefix costs no memory, and one
token may sit in many sequences (a scoring trie's node is in all its tips).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from batchyard.engines.llama.context import Adapter, Sampler
from batchyard.engines.llama_sampling import SamplingParams, build_sampler, token_piece

__all__ = ["NativeContext"]


class NativeContext:
    """One llama context of ``llama``'s model and its batch (see ``Context``)."""

    def __init__(
        self,
        llama: Any,
        *,
        n_cells: int,
        n_seq: int,
        capacity: int,
        threads: int,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self._lib = llama_cpp
        self.model = llama._model
        self.vocab = self.model.vocab
        self.n_vocab: int = llama.n_vocab()
        self.n_seq = min(llama_cpp.llama_max_parallel_sequences(), n_seq)
        self.capacity = capacity
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_cells
        params.n_batch = capacity
        params.n_ubatch = min(capacity, 512)
        params.n_seq_max = self.n_seq
        params.n_threads = params.n_threads_batch = max(1, threads)
        params.kv_unified = True
        # Flash attention, explicitly: its CPU kernel skips masked cells, so a sequence's
        # answer does not depend on where its cells sit in the shared cache (a prefix
        # copied from another sequence leaves gaps). Without it the softmax sums over
        # gaps in another order, and a near-tied greedy pick flipped after a copy. A
        # lone request equals llama-cpp-python's ``Llama(..., flash_attn=True)`` exactly.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self.ctx: Any = _internals.LlamaContext(model=self.model, params=params, verbose=False)
        self.n_cells: int = llama_cpp.llama_n_ctx(self.ctx.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx.ctx)
        # Up to every sequence id on one token: a scoring trie's node is in all its tips.
        self.batch = llama_cpp.llama_batch_init(capacity, 0, self.n_seq)
        # A logits row's address as a plain int (the bindings' own function returns a
        # ctypes pointer, and turning that into an array costs more than the argmax):
        # a separate function object, so the bindings' one is left as it is.
        self._logits_at = llama_cpp.llama_cpp._lib["llama_get_logits_ith"]
        self._logits_at.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self._logits_at.restype = ctypes.c_void_p
        self._row_type = ctypes.c_float * self.n_vocab
        #: Each token's bytes and whether it ends a generation, as first asked: the
        #: vocabulary never changes, and a call into llama.cpp costs more than a lookup.
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self._applied: Adapter | None = None

    # -- one step's batch ----------------------------------------------------------

    def clear_batch(self) -> None:
        self.batch.n_tokens = 0

    def add(self, token: int, pos: int, seqs: list[int], logits: bool) -> int:
        b = self.batch
        i = int(b.n_tokens)
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = len(seqs)
        ids = b.seq_id[i]
        for k, seq in enumerate(seqs):
            ids[k] = seq
        b.logits[i] = logits
        b.n_tokens = i + 1
        return i

    @property
    def batch_size(self) -> int:
        return int(self.batch.n_tokens)

    def decode(self) -> int:
        return int(self._lib.llama_decode(self.ctx.ctx, self.batch))

    def logits(self, row: int) -> Any:
        address = self._logits_at(self.ctx.ctx, row)
        if not address:
            raise RuntimeError(f"llama.cpp has no logits for batch row {row}")
        return np.frombuffer(self._row_type.from_address(address), dtype=np.float32)

    # -- the KV memory -----------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        self._lib.llama_memory_seq_rm(self.memory, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._lib.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def clear(self) -> None:
        self._lib.llama_memory_clear(self.memory, False)

    def state_size(self, seq: int) -> int:
        return int(self._lib.llama_state_seq_get_size(self.ctx.ctx, seq))

    def state_get(self, seq: int, size: int) -> Any | None:
        data = (ctypes.c_uint8 * size)()
        if self._lib.llama_state_seq_get_data(self.ctx.ctx, data, size, seq) != size:
            return None
        return data

    def state_set(self, seq: int, data: Any) -> bool:
        return bool(self._lib.llama_state_seq_set_data(self.ctx.ctx, data, len(data), seq) != 0)

    # -- adapters, vocabulary and sampling -----------------------------------------------

    def set_adapter(self, adapter: Adapter | None) -> None:
        if adapter is self._applied:
            return
        lib = self._lib
        if adapter is None:
            rc = lib.llama_set_adapters_lora(self.ctx.ctx, None, 0, None)
        else:
            handles = (lib.llama_adapter_lora_p_ctypes * 1)(adapter.handle)
            scales = (ctypes.c_float * 1)(adapter.scale)
            rc = lib.llama_set_adapters_lora(self.ctx.ctx, handles, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {rc}")
        self._applied = adapter

    def piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = token_piece(self.vocab, token)
        return piece

    def is_eog(self, token: int) -> bool:
        ends = self._eog.get(token)
        if ends is None:
            ends = self._eog[token] = bool(self._lib.llama_vocab_is_eog(self.vocab, token))
        return ends

    def sampler(self, params: SamplingParams) -> Sampler:
        made: Sampler = build_sampler(self.model, self.n_vocab, params)
        return made

    def sample(self, sampler: Sampler, row: int) -> int:
        chain: Any = sampler
        return int(self._lib.llama_sampler_sample(chain.sampler, self.ctx.ctx, row))

    def close(self) -> None:
        self._lib.llama_batch_free(self.batch)
        self.ctx.close()
