"""Preparing a run's quote: freezing the selected rows and counting their tokens.

A *preparing* run is quoted by the worker that claimed it: the rows the
filter selects are frozen as ``(row id, version)`` work items and counted
with the model's tokenizer, in batches, on a thread (counting is CPU work and
the event loop keeps serving). Each batch is saved with a lease renewal, so a
worker that lost the run stops writing to it; a row whose prompt cannot fit
the model's context window is frozen as failed rather than quoted. The run
then waits in ``awaiting_confirmation`` with the quote's price and expiry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog, ModelSpec
from batchyard.core.clock import Clock, isoformat
from batchyard.core.filters import compile_filter
from batchyard.core.quotes import quote, room
from batchyard.core.runs import (
    TERMINAL,
    ItemState,
    RunStatus,
    prompt_messages,
    prompt_text,
    resolve_model,
)
from batchyard.core.sections import RunSettings
from batchyard.core.tokens import TokenizerSource
from batchyard.errors import BatchyardError, ContextWindowExceeded, InvalidState, NotFound
from batchyard.store import projects as pstore
from batchyard.store import work_items
from batchyard.store.database import Database
from batchyard.store.runs import Run, create_run, link_retry, load_run, update_run

__all__ = ["QuotePreparer", "quoted", "retry_run"]

log = logging.getLogger("batchyard.runs")
S = RunStatus


def quoted(
    model: ModelSpec, spec: dict[str, Any], rows: int, tokens: int, expires: datetime
) -> dict[str, Any]:
    """A run's quote on ``rows`` frozen rows of ``tokens`` input tokens: the columns it sets.

    The one pricing of a run, whether its rows were just counted or copied
    from the run it retries: the model's direct price for every row's
    ``maxOutputTokens`` and samples, at most what the run can be charged.
    """
    max_out = int(spec["sampling"]["maxOutputTokens"])
    samples = int(spec["sampling"]["samplesPerRow"])
    return {
        "status": S.AWAITING_CONFIRMATION,
        "quote_rows": rows,
        "quote_input_tokens": tokens,
        "quote_max_output_tokens": rows * max_out * samples,
        "quote_max_cost": quote(model, tokens, rows * max_out, samples),
        "quote_expires_at": expires,
    }


#: The most ``uncertain`` rows a retry names one by one.
MAX_NAMED = 1000


def retry_run(
    conn: Connection,
    original: Run,
    *,
    run_id: str,
    catalog: Catalog,
    settings: RunSettings,
    now: datetime,
    key_id: str | None,
) -> tuple[Run, dict[str, Any]]:
    """A new run of an ended run's failed and canceled rows, quoted, awaiting confirmation.

    The rows keep their IDs and the versions the first run froze, so the
    retry answers the text that failed; a succeeded row is never sent again,
    nor an ``uncertain`` one (its call may have been answered upstream), and
    the answer says so (``notRetried``). The quote is priced at once, since
    the rows' tokens were counted when they were first frozen; funds are held
    only at ``confirm``, as for any run. The two runs name each other, in
    this transaction: a run is retried once (409 ``already_retried``).
    """
    if original.status not in TERMINAL:
        raise InvalidState(
            f"run {original.id} is still {original.status}; retry it once it ends",
            code="batch_not_ended",
            details={"status": original.status},
        )
    if original.retried_by is not None:
        raise InvalidState(
            f"run {original.id} was already retried by {original.retried_by}; retry that run "
            "instead",
            code="already_retried",
        )
    spec = original.spec
    model, _, _ = resolve_model(catalog, spec["model"], original.org_id)
    create_run(
        conn,
        run_id=run_id,
        org_id=original.org_id,
        project_id=original.project_id,
        dataset_id=original.dataset_id,
        spec=spec,
        now=now,
        key_id=key_id,
    )
    fits = room(model, int(spec["sampling"]["maxOutputTokens"]))
    copied = work_items.copy_for_retry(conn, original.id, run_id, fits=fits, name_at_most=MAX_NAMED)
    if copied.rows == 0:
        raise InvalidState(
            f"run {original.id} has no failed or canceled row to retry"
            + (" that fits the model's context window" if copied.too_long else ""),
            code="nothing_to_retry",
        )
    if not link_retry(conn, original.id, run_id, now):
        raise InvalidState(
            f"run {original.id} was already retried; retry that run instead",
            code="already_retried",
        )
    # A retry's answers join the dataset the first run wrote, where it made one.
    target = original.output_dataset_id if spec["output"]["type"] == "dataset" else None
    if target is not None:
        try:
            pstore.get_dataset(conn, original.org_id, target, original.project_id)
        except NotFound:
            target = None  # deleted since: the retry makes a dataset of its own
    update_run(
        conn,
        run_id,
        now,
        retry_of=original.id,
        output_dataset_id=target,
        **quoted(model, spec, copied.rows, copied.input_tokens, now + settings.quote_ttl),
    )
    work_items.recount(conn, run_id, now)
    report = {
        "of": original.id,
        "rows": copied.rows,
        "notRetried": {
            "succeeded": copied.succeeded,
            "uncertain": copied.uncertain,
            "uncertainRowIds": copied.uncertain_row_ids,
            "tooLong": copied.too_long,
        },
    }
    return load_run(conn, run_id), report


class QuotePreparer:
    """Quotes the preparing runs one worker holds (under its ``owner`` lease)."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        tokenizers: TokenizerSource,
        owner: str,
        settings: RunSettings,
        lease_until: Callable[[], datetime],
        stopping: Callable[[], bool],
    ) -> None:
        self.db = db
        self.clock = clock
        self.catalog = catalog
        self.tokenizers = tokenizers
        self.owner = owner
        self.settings = settings
        self._lease_until = lease_until
        # Whether the worker's loop stopped: a quote on a thread then gives up.
        self._stopping = stopping

    def prepare(self, run: Run) -> None:
        """Freeze and count the selected rows in batches (runs on a thread)."""
        db, clock, spec = self.db, self.clock, run.spec
        try:
            model, _, _ = resolve_model(self.catalog, spec["model"])
        except BatchyardError as exc:
            self._fail(run, exc.code, exc.message)
            return
        tok = self.tokenizers.for_model(model)
        keep = compile_filter(spec.get("filter"))
        source = spec["input"]
        max_out = int(spec["sampling"]["maxOutputTokens"])
        by_field = source.get("type") == "field"
        field = str(source.get("field"))
        # A text field is sent as one user message: the template's tokens are
        # the same for every row, so count them once (never fewer than the
        # template renders: BPE merges across the seam can only save tokens).
        wrap = tok.count_messages([{"role": "user", "content": ""}]) if by_field else 0
        if not db.transact_sync(partial(self._start, run, self._lease_until())):
            log.info("quote abandoned", extra={"run_id": run.id})
            return
        after, rows, tokens = 0, 0, 0
        too_long = json.dumps(
            {
                "code": ContextWindowExceeded.code,
                "message": (
                    f"the prompt and maxOutputTokens exceed the {model.context_window}-token "
                    f"context window of {model.id}"
                ),
            }
        )

        def fetch(a: int) -> tuple[int, list[tuple[int, int]], list[Any]] | None:
            """The next batch after row ``a``: its last row id, refs and prompts.

            Runs on the I/O thread, so JSON parsing and the filter stay off
            the counting thread: that one only tokenizes, as the bare
            tokenizer does.
            """
            batch = db.read_sync(
                lambda c: pstore.current_rows(
                    c, run.dataset_id, after=a, limit=self.settings.prepare_batch
                )
            )
            if not batch:
                return None
            # One parse for the whole batch: the rows are JSON objects we stored.
            datas = json.loads("[" + ",".join([r[2] for r in batch]) + "]")
            refs: list[tuple[int, int]] = []
            prompts: list[Any] = []
            for (row_id, version, _), data in zip(batch, datas, strict=True):
                if not keep(data):
                    continue
                prompt = prompt_text(data, field) if by_field else prompt_messages(data, source)
                if prompt is not None:
                    refs.append((row_id, version))
                    prompts.append(prompt)
            return batch[-1][0], refs, prompts

        def save(
            c: Connection, refs: list[tuple[int, int]], counts: list[int], until: datetime
        ) -> bool:
            now = clock.now()
            if not update_run(
                c, run.id, now, expect=[S.PREPARING], lease=run.lease, lease_expires_at=until
            ):
                return False
            items: list[tuple[int, int, int, str, str | None]] = [
                (row_id, version, n, ItemState.FAILED, too_long)
                if n > fits
                else (row_id, version, n, ItemState.PENDING, None)
                for (row_id, version), n in zip(refs, counts, strict=True)
            ]
            work_items.add_items(c, run.id, items)
            return True

        fits = room(model, max_out)  # the one context-window rule, as a threshold per row
        # Reading and parsing the next batch and saving the last one run on a
        # second thread while this one counts: the tokenizer releases the GIL
        # inside llama.cpp, so the store's work hides behind the counting
        # instead of adding to it (bench/runs.py compares quoting with the
        # bare tokenizer).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchyard-quote-io") as io:
            next_batch = io.submit(fetch, after)
            saved: Future[bool] | None = None
            while True:
                got = next_batch.result()
                if got is None or self._stopping():
                    break
                after, refs, prompts = got
                next_batch = io.submit(fetch, after)
                if by_field:
                    counts = tok.count_batch(prompts)
                    if wrap:
                        counts = [n + wrap for n in counts]
                else:
                    counts = [tok.count_messages(m) for m in prompts]
                if counts and max(counts) <= fits:
                    rows += len(counts)
                    tokens += sum(counts)
                else:
                    kept = [n for n in counts if n <= fits]
                    rows += len(kept)
                    tokens += sum(kept)
                if saved is not None and not saved.result():
                    log.info("quote abandoned", extra={"run_id": run.id})
                    return
                saved = io.submit(
                    db.transact_sync,
                    partial(save, refs=refs, counts=counts, until=self._lease_until()),
                )
            if saved is not None and not saved.result():
                log.info("quote abandoned", extra={"run_id": run.id})
                return
        if self._stopping():
            return
        if rows == 0:
            self._fail(
                run,
                "filter_matches_no_rows",
                "no row of the dataset matches the filter with a prompt to send",
            )
            return

        def finish(c: Connection) -> None:
            now = clock.now()
            if not update_run(
                c,
                run.id,
                now,
                expect=[S.PREPARING],
                lease=run.lease,
                lease_owner=None,
                lease_expires_at=None,
                **quoted(model, spec, rows, tokens, now + self.settings.quote_ttl),
            ):
                return  # another claim holds the run now: its quote is the one that counts
            work_items.recount(c, run.id, now)

        db.transact_sync(finish)
        log.info(
            "quote ready",
            extra={
                "run_id": run.id,
                "rows": rows,
                "input_tokens": tokens,
                "expires": isoformat(clock.now() + self.settings.quote_ttl),
            },
        )

    def _start(self, run: Run, until: datetime, c: Connection) -> bool:
        """Clear a half-prepared quote's rows, if the run is still ours to quote.

        Guarded by the lease like every other write: a worker that stalled
        past its lease and then resumes must not wipe the rows that the
        worker which took the run over has frozen since.
        """
        now = self.clock.now()
        if not update_run(
            c, run.id, now, expect=[S.PREPARING], lease=run.lease, lease_expires_at=until
        ):
            return False
        work_items.clear_items(c, run.id)
        return True

    def _fail(self, run: Run, code: str, message: str) -> None:
        def tx(c: Connection) -> None:
            update_run(
                c,
                run.id,
                self.clock.now(),
                expect=[S.PREPARING],
                lease=run.lease,
                status=S.FAILED,
                error={"code": code, "message": message},
                lease_owner=None,
                lease_expires_at=None,
            )

        self.db.transact_sync(tx)
