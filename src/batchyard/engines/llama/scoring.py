"""Candidate continuations of one prompt as a token trie, decoded in one step.

Candidates that open alike (a decision's ``sentiment: `` before each outcome)
share the trie's nodes. Only a node some candidate goes past is decoded (its
logits row gives the next token of every candidate through it); a candidate's
first token is read from the prompt's own row and its last from its parent's,
so single-token candidates cost no decode at all. Each *tip* (a decoded node
with no decoded child) is one sequence, and a node belongs to the sequences of
every tip below it (one cache cell, many sequence ids), so the whole trie goes
into one ``llama_decode``: beside the prompt's last chunk (``Tuning.score_with_prompt``),
or, when that step has no room for it or the prompt came whole from the cache, the
next step, beside other requests' work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Trie", "lse"]


def lse(row: Any) -> float:
    """The log of the sum of exp over a logits row, in float64 (log-probability = logit - this)."""
    row64 = np.asarray(row, dtype=np.float64)
    peak = float(row64.max())
    return peak + float(np.log(np.exp(row64 - peak).sum()))


@dataclass(eq=False)
class Trie:
    """The decoded nodes of a set of candidates, and where each candidate's tokens are read."""

    conts: list[list[int]]
    #: Decoded nodes, parents first: (token, depth after the prompt, indexes of its tips).
    nodes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    #: Per candidate, per token: the node whose row gives that token (-1: the prompt's row).
    reads: list[list[int]] = field(default_factory=list)
    tips: int = 0

    def __post_init__(self) -> None:
        index: dict[tuple[int, ...], int] = {}
        for cont in self.conts:
            for j in range(1, len(cont)):
                index.setdefault(tuple(cont[:j]), -1)
        inner = sorted(index, key=len)
        index = {p: i for i, p in enumerate(inner)}
        tips = [p for p in inner if not any(q[:-1] == p for q in inner if len(q) == len(p) + 1)]
        self.tips = len(tips)
        self.nodes = [
            (p[-1], len(p) - 1, [t for t, tip in enumerate(tips) if tip[: len(p)] == p])
            for p in inner
        ]
        self.reads = [
            [-1, *(index[tuple(cont[:j])] for j in range(1, len(cont)))] for cont in self.conts
        ]

    @property
    def key(self) -> tuple[tuple[int, ...], ...]:
        """The candidates, hashable: what an answer kept with a prompt was scored for."""
        return tuple(tuple(c) for c in self.conts)

    def scores(self, prompt_row: Any, node_rows: list[Any]) -> list[list[float]]:
        """Each candidate's log-probability per token, from the prompt's row and the nodes'."""
        rows = [prompt_row, *node_rows]
        norms = [lse(r) for r in rows]
        return [
            [float(rows[src + 1][t]) - norms[src + 1] for src, t in zip(reads, cont, strict=True)]
            for reads, cont in zip(self.reads, self.conts, strict=True)
        ]
