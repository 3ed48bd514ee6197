"""Writing a run's completions where its request asked for them.

Answered rows are written in batches after the last call, each batch in one
transaction with a lease renewal, so a worker that lost the run writes
nothing more. ``output.type`` ``field`` sets the field on the source rows (a
new version of each row; one sample is written as a string, several as a
list); ``dataset`` appends ``chat-sft`` rows (the frozen prompt plus one
assistant message per sample) to a dataset created on the first batch.
Rows are marked written as they go, so a worker that takes the run over
resumes where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from batchyard.core.clock import Clock
from batchyard.core.leases import Lease
from batchyard.core.runs import prompt_messages
from batchyard.store import projects as pstore
from batchyard.store import row_versions, work_items
from batchyard.store.database import Database
from batchyard.store.run_leases import renew
from batchyard.store.runs import load_run, update_run

__all__ = ["write_outputs"]


async def write_outputs(
    db: Database,
    clock: Clock,
    run_id: str,
    *,
    lease: Lease,
    lease_until: Callable[[], datetime],
    batch_size: int,
) -> None:
    """Write every answered row of the run, a batch per transaction."""
    while True:
        now, until = clock.now(), lease_until()

        def tx(c: Connection, now: Any = now, until: Any = until) -> int:
            return _write_batch(c, run_id, lease, now, until, batch_size)

        if await db.transact(tx) == 0:
            return


def _write_batch(c: Connection, run_id: str, lease: Lease, now: Any, until: Any, limit: int) -> int:
    """Write one batch of answered rows and mark them written; 0 when done (or not ours)."""
    if renew(c, run_id, lease, until) is None:
        return 0
    run = load_run(c, run_id)
    batch = work_items.succeeded_unwritten(c, run_id, limit)
    if not batch:
        return 0
    output = run.spec["output"]
    samples = int(run.spec["sampling"]["samplesPerRow"])
    if output["type"] == "field":
        values = {r: (outs[0] if samples == 1 and outs else outs) for r, _, outs in batch}
        row_versions.write_field(c, run.dataset_id, output["field"], values, now)
    else:
        target = run.output_dataset_id
        if target is None:
            target = pstore.create_dataset(
                c,
                run.org_id,
                run.project_id,
                output["name"],
                "chat-sft",
                now,
                source_run_id=run.id,
            ).id
            update_run(c, run_id, now, output_dataset_id=target)
        frozen = pstore.rows_at(c, run.dataset_id, [(r, v) for r, v, _ in batch])
        rows = []
        for row_id, _, outs in batch:
            prompt = prompt_messages(frozen.get(row_id, {}), run.spec["input"]) or []
            for i, text in enumerate(outs):
                rows.append(
                    {
                        "messages": [*prompt, {"role": "assistant", "content": text}],
                        "sourceRowId": row_id,
                        "sample": i,
                    }
                )
        pstore.append_rows(c, target, rows, now)
    work_items.mark_written(c, run_id, [r for r, _, _ in batch], now)
    return len(batch)
