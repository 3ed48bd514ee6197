"""An in-memory llama.cpp context for the embedded scheduler's unit tests (``Context``).

It keeps cells as llama.cpp's unified KV cache does: each cell one token at one
position, in a set of sequences; ``seq_cp`` adds a sequence to cells, ``seq_rm``
takes it away, a decode places the batch in the free cells found from where the
last placement ended (llama.cpp's ``head``, wrapping), or refuses (1) when they
are too few; a sequence put back from host memory needs a run of free cells.
Its "model" is a function of what a sequence holds: the logits row of a token
is drawn from a seed made of every token the sequence holds up to it. So a row
is right only if the cache holds exactly the prompt it should (a copied prefix,
a shelved prompt put back, a trie node in its tips): a wrong or missing cell
changes the row, and the decode checks that every sequence of a token holds
positions 0..pos once each.

Token 0 ends a generation and is never likely; token ``t`` >= 1 reads as the
letter ``t - 1`` of the alphabet.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchyard.engines.llama.context import Adapter
from batchyard.engines.llama_sampling import SamplingParams

N_VOCAB = 27
EOG = 0


def logits_for(history: list[int], adapter: str | None = None) -> np.ndarray:
    """The fake model's logits after ``history`` (under ``adapter``'s weights)."""
    seed = zlib.crc32(repr((adapter, tuple(history))).encode())
    row = np.random.default_rng(seed).normal(size=N_VOCAB).astype(np.float32) * 3
    row[EOG] = -50.0
    return row


def log_probs(history: list[int], adapter: str | None = None) -> np.ndarray:
    row = logits_for(history, adapter).astype(np.float64)
    peak = row.max()
    return row - (peak + np.log(np.exp(row - peak).sum()))


def greedy(prompt: list[int], n: int, adapter: str | None = None) -> list[int]:
    """The tokens greedy decoding gives after ``prompt``, read alone."""
    history, out = list(prompt), []
    for _ in range(n):
        token = int(np.argmax(logits_for(history, adapter)))
        out.append(token)
        history.append(token)
    return out


def text_of(tokens: list[int]) -> str:
    return "".join(chr(ord("a") + t - 1) for t in tokens if t)


def score(prompt: list[int], cont: list[int], adapter: str | None = None) -> float:
    """A candidate's log-probability after ``prompt``, computed alone."""
    return float(sum(log_probs(prompt + cont[:j], adapter)[cont[j]] for j in range(len(cont))))


@dataclass
class Cell:
    pos: int
    token: int
    seqs: set[int] = field(default_factory=set)


class FakeSampler:
    def __init__(self, params: SamplingParams, owner: FakeContext) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed or 0)
        self.owner = owner
        owner.samplers += 1

    def close(self) -> None:
        self.owner.samplers -= 1


class FakeContext:
    """``Context`` in memory (see the module's docstring)."""

    def __init__(self, *, n_cells: int = 256, n_seq: int = 16, capacity: int = 64) -> None:
        self.n_cells = n_cells
        self.n_seq = n_seq
        self.capacity = capacity
        self.n_vocab = N_VOCAB
        self.cells: list[Cell | None] = [None] * n_cells
        self.head = 0
        self.batch: list[tuple[int, int, list[int], bool]] = []
        self.rows: dict[int, np.ndarray] = {}
        #: Every decoded batch, in order, and the adapter it was decoded under.
        self.decoded: list[list[tuple[int, int, list[int], bool]]] = []
        self.adapters: list[str | None] = []
        self.adapter: Adapter | None = None
        self.switches = 0
        #: Faults to inject: refuse the next decodes for room, fail one, refuse puts back.
        self.refuse = 0
        self.fail_next = False
        self.refuse_state_set = False
        self.samplers = 0
        self.closed = False

    # -- what the tests read --------------------------------------------------------

    def held(self, seq: int) -> list[int]:
        """The tokens ``seq`` holds, by position."""
        cells = sorted((c for c in self.cells if c and seq in c.seqs), key=lambda c: c.pos)
        return [c.token for c in cells]

    @property
    def used_cells(self) -> int:
        return sum(1 for c in self.cells if c is not None)

    @property
    def highest(self) -> int:
        """One past the highest cell in use (what a step attends over)."""
        return max((i + 1 for i, c in enumerate(self.cells) if c is not None), default=0)

    def tokens_decoded(self) -> int:
        return sum(len(b) for b in self.decoded)

    # -- Context ----------------------------------------------------------------------

    def clear_batch(self) -> None:
        self.batch = []

    def add(self, token: int, pos: int, seqs: list[int], logits: bool) -> int:
        assert len(self.batch) < self.capacity, "the batch is over its capacity"
        self.batch.append((token, pos, list(seqs), logits))
        return len(self.batch) - 1

    @property
    def batch_size(self) -> int:
        return len(self.batch)

    def decode(self) -> int:
        if self.fail_next:
            self.fail_next = False
            return -1
        if self.refuse:
            self.refuse -= 1
            return 1
        order = [*range(self.head, self.n_cells), *range(self.head)]
        free = [i for i in order if self.cells[i] is None][: len(self.batch)]
        if len(free) < len(self.batch):
            return 1
        self.head = (free[-1] + 1) % self.n_cells if free else self.head
        for (token, pos, seqs, _), i in zip(self.batch, free, strict=False):
            for seq in seqs:
                assert 0 <= seq < self.n_seq
                assert not any(c and seq in c.seqs and c.pos == pos for c in self.cells), (
                    f"sequence {seq} already holds position {pos}"
                )
            self.cells[i] = Cell(pos, token, set(seqs))
        self.rows = {}
        name = self.adapter.name if self.adapter is not None else None
        for row, (_, pos, seqs, logits) in enumerate(self.batch):
            if not logits:
                continue
            histories = {tuple(self._history(seq, pos)) for seq in seqs}
            assert len(histories) == 1, "the sequences of one token hold different prompts"
            self.rows[row] = logits_for(list(histories.pop()), name)
        self.decoded.append(list(self.batch))
        self.adapters.append(name)
        return 0

    def _history(self, seq: int, pos: int) -> list[int]:
        cells = sorted(
            (c for c in self.cells if c and seq in c.seqs and c.pos <= pos), key=lambda c: c.pos
        )
        assert [c.pos for c in cells] == list(range(pos + 1)), (
            f"sequence {seq} holds positions {[c.pos for c in cells]} at {pos}"
        )
        return [c.token for c in cells]

    def logits(self, row: int) -> Any:
        return self.rows[row]

    def seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        end = p1 if p1 >= 0 else 1 << 30
        for i, c in enumerate(self.cells):
            if c is not None and seq in c.seqs and max(p0, 0) <= c.pos < end:
                c.seqs.discard(seq)
                if not c.seqs:
                    self.cells[i] = None

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        end = p1 if p1 >= 0 else 1 << 30
        for c in self.cells:
            if c is not None and src in c.seqs and max(p0, 0) <= c.pos < end:
                c.seqs.add(dst)

    def clear(self) -> None:
        self.cells = [None] * self.n_cells
        self.head = 0

    def state_size(self, seq: int) -> int:
        return 100 * len(self.held(seq))

    def state_get(self, seq: int, size: int) -> Any | None:
        return list(enumerate(self.held(seq)))

    def state_set(self, seq: int, data: Any) -> bool:
        if self.refuse_state_set:
            return False
        need = len(data)
        for start in [*range(self.head, self.n_cells), *range(self.head)]:
            span = self.cells[start : start + need]
            if len(span) == need and all(c is None for c in span):
                for k, (pos, token) in enumerate(data):
                    self.cells[start + k] = Cell(pos, token, {seq})
                self.head = (start + need) % self.n_cells
                return True
        return need == 0

    def set_adapter(self, adapter: Adapter | None) -> None:
        self.adapter = adapter
        self.switches += 1

    def piece(self, token: int) -> bytes:
        return text_of([token]).encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def sampler(self, params: SamplingParams) -> FakeSampler:
        return FakeSampler(params, self)

    def sample(self, sampler: Any, row: int) -> int:
        """The likeliest token at temperature 0, else one of the three likeliest, seeded."""
        logits = self.rows[row]
        best = np.argsort(-logits)[:3]
        if sampler.params.temperature <= 0:
            return int(best[0])
        return int(sampler.rng.choice(best))

    def close(self) -> None:
        self.closed = True
