"""One way in, one way to pay: every door and batch format charges usage × its route's price.

Every way a call comes in (the chat, completions, embeddings and Messages doors, a line
of an OpenAI batch file, a request of a Message Batch, a deferred item and a run's row)
× what a request may carry (plain, tools where the way serves them, ``n`` > 1, a long
system prompt): the charge is the call's usage at the price it runs at, to the tick, and
the hold it was paid from (a batch line's or a run row's own share of its batch's hold)
is never below it. The real embedded model answers and its own tokenizer counts, so a
quote that misses what the engine reads (the tools' instructions, the chat template, a
system prompt) shows up here as a charge above its hold, which settlement records
instead of capping (``store.billing``) and the ledger audit after every test lists.

Images: no route of the default catalog reads images (the embedded model reads text
only; kettei-chub and kettei-fat have no route until an operator points one at an
engine that can see), so no way serves them here. Decide pays through
``Dispatcher.paying`` like the others: its variants are one decision, several (``n``),
and a long text (``system``), each with the content-free calibration its first call
estimates, whose prompts the charge includes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from batchyard.core.money import charge_ticks, quote_ticks
from batchyard.service import Service
from batchyard.store import activity, ledger
from batchyard.store.runs import run_items
from tests.support.accounts import Account, make_account
from tests.support.file_batches import jsonl, lines_of, upload
from tests.support.file_batches import worker as file_worker
from tests.support.runs import Api, fast_runs
from tests.support.server import asgi_client

pytestmark = pytest.mark.model

MODEL = "kettei-core"
#: kettei-core's own price: what a door's call and a batch line without a discount pay.
DIRECT = (Decimal("0.10"), Decimal("0.40"))
#: The embedded route's price: what a deferred item pays (the route's offer).
ROUTE = (Decimal("0.005"), Decimal("0.02"))
MAX_TOKENS = 8
SYSTEM = " ".join(
    f"Rule {i}: answer in one short sentence, in plain words, and never list more than "
    "three things."
    for i in range(12)
)
ASK = "Which city is warmest today: Lisbon, Oslo or Cairo?"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    ("get_weather", "The weather now in a city."),
    ("get_time", "The local time in a city."),
    ("convert_currency", "An amount converted from one currency to another."),
    ("translate", "A text translated into another language."),
    ("search_flights", "Flights between two cities on a day."),
    ("book_table", "A restaurant table booked in a city."),
]
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": n, "description": d, "parameters": CITY}}
    for n, d in TOOLS
]
ANTHROPIC_TOOLS = [{"name": n, "description": d, "input_schema": CITY} for n, d in TOOLS]

#: What a request carries besides its question.
VARIANTS = ("plain", "tools", "n", "system")


@dataclass(frozen=True)
class Paid:
    """One call as the books have it: its usage, its price, the charge posted, its hold."""

    what: str
    input_tokens: int
    output_tokens: int
    price: tuple[Decimal, Decimal]
    charged: int
    hold: int


def chat_body(variant: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.7}
    if variant == "system":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    if variant == "tools":
        body["tools"] = OPENAI_TOOLS
    if variant == "n":
        body["n"] = 2
    return {**body, "messages": messages}


def messages_body(variant: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": ASK}],
    }
    if variant == "system":
        body["system"] = SYSTEM
    if variant == "tools":
        body["tools"] = ANTHROPIC_TOOLS
    return body


def prompt_text(variant: str) -> str:
    return f"{SYSTEM}\n\n{ASK}" if variant == "system" else ASK


def charges_of(service: Service, acct: Account) -> list[Paid]:
    """Each settled call of the account: its record's usage and amount, and its hold."""

    def read(c: Any) -> list[Paid]:
        out = []
        for act in activity.list_activity(c, acct.org_id, limit=1000):
            if act["kind"] != "charge":
                continue
            detail = act["detail"]
            # A batch's or a run's record sums its lines, each priced when it ended.
            price = detail.get("price") or {"input_per_mtok": "0", "output_per_mtok": "0"}
            hold = ledger.get_reservation(c, act["reservation_id"]).amount
            out.append(
                Paid(
                    f"{detail['purpose']} {act['ref']}",
                    detail["input_tokens"],
                    detail["output_tokens"],
                    (Decimal(price["input_per_mtok"]), Decimal(price["output_per_mtok"])),
                    act["amount"],
                    hold,
                )
            )
        return out

    return service.db.read_sync(read)


# -- the ways in ----------------------------------------------------------------------


async def chat(service: Service, http: httpx.AsyncClient, acct: Account, v: str) -> list[Paid]:
    r = await http.post("/v1/chat/completions", json=chat_body(v), headers=acct.headers)
    assert r.status_code == 200, r.text
    [paid] = charges_of(service, acct)
    usage = r.json()["usage"]
    assert (paid.input_tokens, paid.output_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert paid.price == DIRECT
    return [paid]


async def completions(
    service: Service, http: httpx.AsyncClient, acct: Account, v: str
) -> list[Paid]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt_text(v), "max_tokens": MAX_TOKENS}
    if v == "n":
        body["n"] = 2
    r = await http.post("/v1/completions", json=body, headers=acct.headers)
    assert r.status_code == 200, r.text
    [paid] = charges_of(service, acct)
    assert paid.input_tokens == r.json()["usage"]["prompt_tokens"] and paid.price == DIRECT
    return [paid]


async def embeddings(
    service: Service, http: httpx.AsyncClient, acct: Account, v: str
) -> list[Paid]:
    inputs: str | list[str] = [ASK, SYSTEM] if v == "n" else prompt_text(v)
    r = await http.post(
        "/v1/embeddings", json={"model": MODEL, "input": inputs}, headers=acct.headers
    )
    assert r.status_code == 200, r.text
    [paid] = charges_of(service, acct)
    assert paid.input_tokens == r.json()["usage"]["prompt_tokens"] and paid.output_tokens == 0
    return [paid]


async def messages(service: Service, http: httpx.AsyncClient, acct: Account, v: str) -> list[Paid]:
    headers = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    r = await http.post("/v1/messages", json=messages_body(v), headers=headers)
    assert r.status_code == 200, r.text
    [paid] = charges_of(service, acct)
    usage = r.json()["usage"]
    read = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
    assert (paid.input_tokens, paid.output_tokens) == (read, usage["output_tokens"])
    return [paid]


async def _lines(
    service: Service, acct: Account, batch_id: str, price: tuple[Decimal, Decimal]
) -> list[Paid]:
    """A file batch's lines, each with its own share of the batch's one hold."""
    await file_worker(service).run_until_idle()
    rows = lines_of(service, batch_id)
    assert rows and all(row.state == "succeeded" for row in rows), rows
    paid = []
    for row in rows:
        share = quote_ticks((row.input_tokens * price[0] + row.max_tokens * price[1]) / 10**6)
        paid.append(
            Paid(f"line {row.line}", row.usage_input, row.usage_output, price, row.charge, share)
        )
    # The batch settles once: its lines' charges, summed, within its one hold.
    [batch] = charges_of(service, acct)
    assert batch.charged == sum(p.charged for p in paid) <= batch.hold
    return paid


async def batch_line(
    service: Service, http: httpx.AsyncClient, acct: Account, v: str
) -> list[Paid]:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}
    up = await upload(http, acct.headers, jsonl([{**line, "body": chat_body(v)}]))
    assert up.status_code == 200, up.text
    body = {
        "input_file_id": up.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    r = await http.post("/v1/batches", json=body, headers=acct.headers)
    assert r.status_code == 200, r.text
    return await _lines(service, acct, r.json()["id"], DIRECT)


async def message_batch(
    service: Service, http: httpx.AsyncClient, acct: Account, v: str
) -> list[Paid]:
    headers = {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}
    body = {"requests": [{"custom_id": "a", "params": messages_body(v)}]}
    r = await http.post("/v1/messages/batches", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return await _lines(service, acct, r.json()["id"], DIRECT)


async def deferred_item(
    service: Service, http: httpx.AsyncClient, acct: Account, v: str
) -> list[Paid]:
    body = {"min_discount": 90, "requests": [{"custom_id": "a", "body": chat_body(v)}]}
    headers = {**acct.headers, "Idempotency-Key": f"deferred-{v}"}
    r = await http.post("/v1/batches", json=body, headers=headers)
    assert r.status_code == 201, r.text
    report = await service.deferred_batches.run_pass()
    assert report.succeeded == 1, report
    [paid] = charges_of(service, acct)
    assert paid.price == ROUTE  # the route's offered price, not the direct one
    return [paid]


async def run_row(service: Service, http: httpx.AsyncClient, acct: Account, v: str) -> list[Paid]:
    samples = 2 if v == "n" else 1
    api = await Api(http, acct.headers).start()
    row = {"messages": chat_body(v)["messages"]}
    spec = {
        "model": {"type": "base", "id": MODEL},
        "input": {"type": "messages"},
        "output": {"type": "field", "field": "answer"},
        "sampling": {"maxOutputTokens": MAX_TOKENS, "samplesPerRow": samples},
    }
    run_id, _ = await api.confirmed([row], spec)
    await api.wait(run_id, "completed")
    items = service.db.read_sync(
        lambda c: c.execute(select(run_items).where(run_items.c.run_id == run_id)).all()
    )
    paid = []
    for item in items:
        share = quote_ticks(
            (item.input_tokens * DIRECT[0] + MAX_TOKENS * samples * DIRECT[1]) / 10**6
        )
        paid.append(Paid("row", item.usage_input, item.usage_output, DIRECT, item.charge, share))
    [run] = charges_of(service, acct)
    assert run.charged == sum(p.charged for p in paid) <= run.hold
    return paid


async def decide(service: Service, http: httpx.AsyncClient, acct: Account, v: str) -> list[Paid]:
    mood = {
        "id": "mood",
        "question": "How does the writer feel?",
        "outcomes": [{"id": "pleased"}, {"id": "unhappy"}],
    }
    city = {
        "id": "city",
        "question": "Which city does it name?",
        "outcomes": [{"id": "lisbon"}, {"id": "oslo"}, {"id": "cairo"}],
    }
    body = {
        "model": MODEL,
        "input": {"text": SYSTEM if v == "system" else ASK},
        "decisions": [mood, city] if v == "n" else [mood],
    }
    r = await http.post("/v1/decide", json=body, headers=acct.headers)
    assert r.status_code == 200, r.text
    [paid] = charges_of(service, acct)
    usage = r.json()["usage"]
    assert (paid.input_tokens, paid.output_tokens) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )
    assert paid.price == DIRECT and paid.charged == charge_ticks(Decimal(r.json()["charge"]))
    return [paid]


Way = Callable[[Service, httpx.AsyncClient, Account, str], Awaitable[list[Paid]]]

#: Every way a call comes in, and what it serves of ``VARIANTS``.
WAYS: dict[str, tuple[Way, tuple[str, ...]]] = {
    "chat": (chat, VARIANTS),
    "completions": (completions, ("plain", "n", "system")),
    "embeddings": (embeddings, ("plain", "n", "system")),
    "messages": (messages, ("plain", "tools", "system")),
    "batch_line": (batch_line, VARIANTS),
    "message_batch": (message_batch, ("plain", "tools", "system")),
    "deferred_item": (deferred_item, ("plain", "system")),
    "run_row": (run_row, ("plain", "n", "system")),
    "decide": (decide, ("plain", "n", "system")),
}


@pytest.mark.parametrize(
    ("way", "variant"),
    [(w, v) for w, (_, served) in WAYS.items() for v in served],
)
async def test_every_way_in_charges_usage_at_its_price_within_its_hold(
    make_service: Any, way: str, variant: str
) -> None:
    service = make_service(runs=fast_runs())
    acct = make_account(service, credit="1")
    pay, _ = WAYS[way]
    async with asgi_client(service, worker=way == "run_row") as http:
        paid = await pay(service, http, acct, variant)
    assert paid
    for p in paid:
        due = (p.input_tokens * p.price[0] + p.output_tokens * p.price[1]) / 10**6
        assert p.input_tokens > 0 and p.charged == charge_ticks(due), p
        assert p.hold >= p.charged, p
