"""The seam between the scheduler and llama.cpp: the calls one context answers.

Everything the scheduler and the cache manager ask of llama.cpp goes through
``Context``: the batch of one step and its decode, the logits rows it gave,
the KV memory's sequence calls (``llama_memory_seq_*``), a sequence's state
copied to host memory and back (``llama_state_seq_*``), the adapter set on the
context, and one sequence's sampler. ``NativeContext`` (``engines.llama.native``)
makes those calls on a real context; the unit tests run the scheduler over an
in-memory one that keeps cells and sequence ids as llama.cpp does.

Positions follow llama.cpp's convention: ``p1 = -1`` means "to the end".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from batchyard.engines.llama_sampling import SamplingParams

__all__ = ["Adapter", "Context", "Sampler"]


@dataclass(eq=False)
class Adapter:
    """A LoRA adapter loaded once on the scheduler's model (``llama_adapter_lora_init``)."""

    name: str
    handle: Any
    scale: float = 1.0
    #: Its tensors' bytes, for the engine's memory budget.
    bytes: int = 0
    released: bool = False


class Sampler(Protocol):
    """One sequence's sampler chain; closed when its branch ends."""

    def close(self) -> None: ...


class Context(Protocol):
    """One llama context: its KV memory, one step's batch, and what a decode gave."""

    #: Cells the KV memory holds, sequence ids it serves, tokens one batch holds.
    n_cells: int
    n_seq: int
    capacity: int
    n_vocab: int

    # -- one step's batch --------------------------------------------------------

    def clear_batch(self) -> None:
        """Start the next step's batch empty."""

    def add(self, token: int, pos: int, seqs: list[int], logits: bool) -> int:
        """Put ``token`` at ``pos`` in ``seqs`` into the batch; returns its row."""

    @property
    def batch_size(self) -> int:
        """Tokens in the batch now."""

    def decode(self) -> int:
        """``llama_decode`` of the batch: 0, 1 (no room for it: nothing changed) or an error."""

    def logits(self, row: int) -> Any:
        """The logits of batch row ``row`` (a float32 vector, valid until the next decode)."""

    # -- the KV memory ---------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Free ``seq``'s cells at positions ``[p0, p1)``."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Make ``src``'s cells at positions ``[p0, p1)`` ``dst``'s too (no copy of data)."""

    def clear(self) -> None:
        """Free every cell of every sequence."""

    def state_size(self, seq: int) -> int:
        """Bytes ``state_get`` would copy out of ``seq``."""

    def state_get(self, seq: int, size: int) -> Any | None:
        """``seq``'s cells copied to host memory (None: the copy failed)."""

    def state_set(self, seq: int, data: Any) -> bool:
        """Put saved cells back into ``seq`` (False: no run of free cells long enough)."""

    # -- adapters, vocabulary and sampling ---------------------------------------------

    def set_adapter(self, adapter: Adapter | None) -> None:
        """Apply ``adapter`` (None: the base weights) to the steps decoded from now on."""

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for."""

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation."""

    def sampler(self, params: SamplingParams) -> Sampler:
        """A fresh sampler chain for one sequence."""

    def sample(self, sampler: Sampler, row: int) -> int:
        """The token ``sampler`` picks from batch row ``row``."""

    def close(self) -> None:
        """Free the context and its batch."""
