"""Quoting a run on its own: which rows are frozen, how they are counted, what is priced.

``QuotePreparer.prepare`` runs on a worker's thread in production; here the
test calls it directly, with an in-memory store, a clock only the test moves
and a model whose tokenizer is the fallback one (no model file needed), or a
tokenizer the test hands it.
"""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

from batchyard.core.catalog import Catalog, ModelSpec
from batchyard.core.clock import ManualClock
from batchyard.core.money import quote_ticks
from batchyard.core.runs import ItemState, RunStatus
from batchyard.core.sections import RunSettings
from batchyard.core.tokens import FallbackTokenizer, Tokenizer, TokenizerSource
from batchyard.engines.tokenizers import Tokenizers
from batchyard.store import row_versions
from batchyard.store.database import Database
from batchyard.store.run_leases import claim_run
from batchyard.store.runs import update_run
from batchyard.work.runs.quoting import QuotePreparer
from tests.support.run_store import add_dataset, add_org, add_run, items, load, run_spec
from tests.unit.work.conftest import MODEL, PRICE, catalog

S = RunStatus
OWNER = "wkr.a"
LEASE = timedelta(seconds=60)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


class Words:
    """A tokenizer that is not the fallback one: a token is a word, each message costs 3."""

    name = "words"
    exact = True

    def count(self, text: str) -> int:
        return len(text.split())

    def count_batch(self, texts: list[str]) -> list[int]:
        return [self.count(t) for t in texts]

    def count_messages(self, messages: list[dict[str, Any]]) -> int:
        return sum(self.count(str(m["content"])) + 3 for m in messages)


class Given:
    """Hands the quote one tokenizer whatever the model, and says which model asked."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.asked: list[str] = []

    def for_model(self, model: ModelSpec) -> Tokenizer:
        self.asked.append(model.id)
        return self.tokenizer


def preparer(
    db: Database,
    clock: ManualClock,
    *,
    owner: str = OWNER,
    tokenizers: TokenizerSource | None = None,
    cat: Catalog | None = None,
    batch: int = 2000,
    stopping: Any = lambda: False,
) -> QuotePreparer:
    return QuotePreparer(
        db=db,
        clock=clock,
        catalog=cat or catalog(),
        tokenizers=tokenizers or Tokenizers(),
        owner=owner,
        settings=RunSettings(prepare_batch=batch),
        lease_until=lambda: clock.now() + LEASE,
        stopping=stopping,
    )


def claimed_run(
    db: Database,
    clock: ManualClock,
    rows: list[dict[str, Any]],
    *,
    kind: str = "text",
    owner: str = OWNER,
    **spec: Any,
) -> tuple[str, str]:
    """A preparing run over ``rows``, claimed by ``owner`` as the worker would: (run, dataset)."""
    now = clock.now()
    org = add_org(db, now)
    project, ds = add_dataset(db, now, org, rows, kind=kind)
    run_id = add_run(db, now, org_id=org, project_id=project, dataset_id=ds, spec=run_spec(**spec))
    claimed = db.transact_sync(
        lambda c: claim_run(c, owner, now, now + LEASE, statuses=[S.PREPARING])
    )
    assert claimed is not None and claimed.id == run_id
    return run_id, ds


def frozen(db: Database, run_id: str) -> list[tuple[int, int, int, str]]:
    return [(i["row_id"], i["version"], i["input_tokens"], i["state"]) for i in items(db, run_id)]


def test_the_quote_freezes_exactly_the_filtered_rows_at_their_current_versions(
    db: Database, clock: ManualClock
) -> None:
    rows = [
        {"text": "ship my order", "lang": "en"},
        {"text": "où est mon colis", "lang": "fr"},  # filtered out
        {"text": "refund please", "lang": "en"},  # edited below: version 2 is quoted
        {"text": "   ", "lang": "en"},  # no prompt to send: left out, not paid for
        {"lang": "en"},  # no prompt field at all
        {"text": "late again", "lang": "en"},
    ]
    run_id, ds = claimed_run(
        db, clock, rows, max_out=8, samples=2, row_filter={"field": "lang", "eq": "en"}
    )
    db.transact_sync(
        lambda c: row_versions.write_field(c, ds, "text", {3: "refund please now"}, clock.now())
    )

    preparer(db, clock, batch=2).prepare(load(db, run_id))

    tok = FallbackTokenizer()
    counts = {1: "ship my order", 3: "refund please now", 6: "late again"}
    want = {r: tok.count_messages(user(t)) for r, t in counts.items()}
    assert frozen(db, run_id) == [
        (1, 1, want[1], ItemState.PENDING),
        (3, 2, want[3], ItemState.PENDING),
        (6, 1, want[6], ItemState.PENDING),
    ]
    run = load(db, run_id)
    assert run.status == S.AWAITING_CONFIRMATION
    assert (run.quote_rows, run.quote_input_tokens) == (3, sum(want.values()))
    assert run.quote_max_output_tokens == 3 * 8 * 2
    assert run.quote_max_cost == quote_ticks(PRICE.cost(sum(want.values()), 48))
    assert run.quote_expires_at == clock.now() + RunSettings().quote_ttl
    assert (run.rows_total, run.rows_failed) == (3, 0)
    assert (run.lease_owner, run.lease_expires_at) == (None, None)


def test_rows_are_counted_with_the_tokenizer_the_quote_is_given(
    db: Database, clock: ManualClock
) -> None:
    rows = [{"text": "one two three"}, {"text": "four five"}]
    run_id, _ = claimed_run(db, clock, rows, max_out=4)
    given = Given(Words())

    preparer(db, clock, tokenizers=given).prepare(load(db, run_id))

    assert given.asked == ["m"]
    # A text field is one user message: 3 words + the tokenizer's 3 per message.
    assert [i[2] for i in frozen(db, run_id)] == [6, 5]
    assert load(db, run_id).quote_input_tokens == 11


def test_chat_rows_are_counted_as_the_messages_they_send(db: Database, clock: ManualClock) -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    rows: list[dict[str, Any]] = [
        {"messages": chat},
        {"messages": "not a conversation"},  # no usable prompt: left out
        {"messages": user("hi")},
    ]
    run_id, _ = claimed_run(db, clock, rows, kind="chat-sft", field=None, max_out=4)

    preparer(db, clock, tokenizers=Given(Words())).prepare(load(db, run_id))

    assert frozen(db, run_id) == [(1, 1, 10, ItemState.PENDING), (3, 1, 4, ItemState.PENDING)]
    assert load(db, run_id).quote_rows == 2


def test_a_row_that_cannot_fit_the_context_window_is_frozen_as_failed_and_not_priced(
    db: Database, clock: ManualClock
) -> None:
    wrap = FallbackTokenizer().count_messages(user(""))
    fits = "x" * (MODEL.context_window - 8 - wrap)  # prompt + maxOutputTokens == the window
    rows = [{"text": fits}, {"text": fits + "x"}, {"text": "short"}]
    run_id, _ = claimed_run(db, clock, rows, max_out=8)

    preparer(db, clock).prepare(load(db, run_id))

    [first, second, third] = items(db, run_id)
    assert (first["state"], first["input_tokens"]) == (ItemState.PENDING, MODEL.context_window - 8)
    assert (second["state"], second["input_tokens"]) == (ItemState.FAILED, MODEL.context_window - 7)
    assert json.loads(second["error"])["code"] == "context_window_exceeded"
    assert third["state"] == ItemState.PENDING
    run = load(db, run_id)
    assert run.status == S.AWAITING_CONFIRMATION
    assert run.quote_rows == 2
    assert run.quote_input_tokens == first["input_tokens"] + third["input_tokens"]
    assert (run.rows_total, run.rows_failed) == (3, 1)


class TakenOverWhileCounting(FallbackTokenizer):
    """Another worker takes the run over while this one counts its second batch."""

    def __init__(self, db: Database, clock: ManualClock, run_id: str) -> None:
        self.db, self.clock, self.run_id = db, clock, run_id
        self.batches = 0

    def count_batch(self, texts: list[str]) -> list[int]:
        self.batches += 1
        if self.batches == 2:
            self.db.transact_sync(
                lambda c: update_run(c, self.run_id, self.clock.now(), lease_owner="wkr.b")
            )
        return super().count_batch(texts)


def test_a_quote_whose_lease_was_lost_is_abandoned(db: Database, clock: ManualClock) -> None:
    rows = [{"text": f"row {i}"} for i in range(1, 11)]
    run_id, _ = claimed_run(db, clock, rows)
    counter = TakenOverWhileCounting(db, clock, run_id)

    preparer(db, clock, tokenizers=Given(counter), batch=2).prepare(load(db, run_id))

    # It stops counting as soon as a save tells it the run is no longer its own.
    assert counter.batches <= 3

    run = load(db, run_id)
    assert (run.status, run.lease_owner) == (S.PREPARING, "wkr.b")
    assert (run.quote_rows, run.quote_max_cost, run.quote_expires_at) == (None, None, None)
    # Nothing counted after the takeover was written; the first batch's save
    # may have landed before it, and the new owner's quote clears it.
    assert {i["row_id"] for i in items(db, run_id)} <= {1, 2}


def test_a_quote_given_up_when_its_worker_stops_is_done_again_by_the_next_owner(
    db: Database, clock: ManualClock
) -> None:
    rows = [{"text": f"row {i}"} for i in range(1, 6)]
    run_id, _ = claimed_run(db, clock, rows)
    stopped = Given(FallbackTokenizer())
    calls = {"n": 0}

    def stopping() -> bool:
        calls["n"] += 1
        return calls["n"] > 2  # the loop stops after the first batch

    preparer(db, clock, tokenizers=stopped, batch=2, stopping=stopping).prepare(load(db, run_id))
    assert load(db, run_id).status == S.PREPARING
    assert len(items(db, run_id)) < 5

    clock.advance(LEASE.total_seconds() + 1)  # its lease expires; another worker claims it
    now = clock.now()
    taken = db.transact_sync(
        lambda c: claim_run(c, "wkr.b", now, now + LEASE, statuses=[S.PREPARING])
    )
    assert taken is not None
    preparer(db, clock, owner="wkr.b", batch=2).prepare(taken)

    assert [i["row_id"] for i in items(db, run_id)] == [1, 2, 3, 4, 5]
    assert load(db, run_id).quote_rows == 5


def test_a_filter_that_matches_no_row_fails_the_run(db: Database, clock: ManualClock) -> None:
    run_id, _ = claimed_run(
        db, clock, [{"text": "hi", "lang": "en"}], row_filter={"field": "lang", "eq": "de"}
    )

    preparer(db, clock).prepare(load(db, run_id))

    run = load(db, run_id)
    assert run.status == S.FAILED
    assert run.error is not None and run.error["code"] == "filter_matches_no_rows"
    assert items(db, run_id) == []
    assert run.lease_owner is None


def test_a_model_that_left_the_catalog_fails_the_run(db: Database, clock: ManualClock) -> None:
    run_id, _ = claimed_run(db, clock, [{"text": "hi"}])
    other = ModelSpec("other", Decimal(1), Decimal(1), 4096)

    preparer(db, clock, cat=Catalog([other], [])).prepare(load(db, run_id))

    run = load(db, run_id)
    assert run.status == S.FAILED
    assert run.error is not None and run.error["code"] == "unknown_model"


def test_a_worker_that_resumes_after_losing_its_lease_leaves_the_new_owner_s_quote_alone(
    db: Database, clock: ManualClock
) -> None:
    rows = [{"text": f"row {i}"} for i in range(1, 4)]
    run_id, _ = claimed_run(db, clock, rows)
    stale = load(db, run_id)  # wkr.a claimed it, then stalled before it began quoting

    clock.advance(LEASE.total_seconds() + 1)
    now = clock.now()
    taken = db.transact_sync(
        lambda c: claim_run(c, "wkr.b", now, now + LEASE, statuses=[S.PREPARING])
    )
    assert taken is not None
    preparer(db, clock, owner="wkr.b").prepare(taken)
    quoted = load(db, run_id)
    assert quoted.status == S.AWAITING_CONFIRMATION

    preparer(db, clock).prepare(stale)  # wkr.a wakes up and carries on

    assert [i["row_id"] for i in items(db, run_id)] == [1, 2, 3]
    assert load(db, run_id) == quoted
