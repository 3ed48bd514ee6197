"""Following a batch while it runs: its finished items, from a cursor, in the final format.

Batch APIs give nothing until a batch ends; a user with 200,000 lines wants
the first answers now, to check them before the rest are paid for. Every
batch kind (file batches, Message Batches, deferred batches, runs) numbers
its items in the order they end (``store.end_order``), so one page shape
serves them all: the items that ended after the caller's cursor, oldest
first, each exactly as the kind's final results show it (an OpenAI output-
or error-file line, an Anthropic result line, a deferred batch's result
line, a run's output row), and the cursor to ask from next time.

``ended`` says the batch has ended: once it is true and ``has_more`` is
false, the reader has seen every item. The status is read before the items
(in the same read), so a batch seen ended has all its items numbered.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection

from batchyard.core.clock import isoformat
from batchyard.core.sealing import Sealer
from batchyard.store import file_batches as store
from batchyard.store import work_items

__all__ = ["MAX_PAGE", "file_batch_items", "page", "run_items"]

#: The most items one page holds.
MAX_PAGE = 1000


def page(
    items: Sequence[tuple[int, dict[str, Any]]], *, after: int, limit: int, ended: bool
) -> dict[str, Any]:
    """One page from up to ``limit + 1`` ``(end number, item)`` pairs read after ``after``."""
    shown = list(items[:limit])
    return {
        "object": "list",
        "data": [item for _, item in shown],
        "cursor": str(shown[-1][0] if shown else after),
        "has_more": len(items) > limit,
        "ended": ended,
    }


def file_batch_items(
    conn: Connection,
    sealer: Sealer,
    batch_id: str,
    *,
    after: int,
    limit: int,
    render: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """Up to ``limit + 1`` lines of a file batch that ended after ``after``, opened.

    Each is the line of the output or error file it will be in; ``render``
    rewrites it for another dialect (a Message Batch's result line).
    """
    items = []
    for seq, line, sealed in store.ended_lines(conn, batch_id, after=after, limit=limit + 1):
        stored = json.loads(sealer.open(sealed, store.out_aad(batch_id, line)))
        items.append((seq, render(stored) if render is not None else stored))
    return items


def run_items(
    conn: Connection, run_id: str, *, after: int, limit: int
) -> list[tuple[int, dict[str, Any]]]:
    """Up to ``limit + 1`` rows of a run that ended after ``after``.

    Each as the run's ``/failures`` shows a row, with its ``outputs`` while
    they wait in the run; a run writes its answers into the dataset when its
    calls are done, and a row written there says ``written`` (its answers
    are read from the dataset then: the run keeps no second copy).
    """
    items = work_items.ended_rows(conn, run_id, after=after, limit=limit + 1)
    for _, item in items:
        item["updatedAt"] = isoformat(item["updatedAt"]) if item["updatedAt"] else None
    return items
