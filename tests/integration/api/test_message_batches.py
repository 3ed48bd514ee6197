"""Anthropic's Message Batches over HTTP, on the file-batch machinery underneath.

The file-batch worker is driven by the test (``worker=False`` and
``run_until_idle``), so each state is seen as it is.
"""

from __future__ import annotations

import json

from batchyard.core.accounts import Scope
from batchyard.core.money import parse_money, to_ticks
from batchyard.store import ledger
from tests.support.accounts import add_key, make_account
from tests.support.deferred_batches import BlockingEngine, eventually
from tests.support.file_batches import lines_of, worker
from tests.support.server import asgi_client
from tests.support.workspace import answer_with

PATH = "/v1/messages/batches"


def request(cid: str, text: str = "Say hi.", **params) -> dict:
    return {
        "custom_id": cid,
        "params": {
            "model": "kettei-core",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": text}],
            **params,
        },
    }


def headers(acct) -> dict[str, str]:
    return {"x-api-key": acct.key, "anthropic-version": "2023-06-01"}


def balance(service, org_id):
    return service.db.read_sync(lambda c: ledger.balance(c, org_id))


def results(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line]


async def test_create_run_and_read_results_keyed_by_custom_id(service):
    engine = answer_with(service, "hello there")
    acct = make_account(service, credit="1")
    body = {
        "requests": [request(f"req-{i}", f"Say hi to {i}.", system="Be brief.") for i in range(4)]
    }
    async with asgi_client(service, worker=False) as http:
        r = await http.post(PATH, json=body, headers=headers(acct))
        assert r.status_code == 200, r.text
        batch = r.json()
        assert batch["type"] == "message_batch" and batch["processing_status"] == "in_progress"
        assert batch["request_counts"] == {
            "processing": 4,
            "succeeded": 0,
            "errored": 0,
            "canceled": 0,
            "expired": 0,
        }
        assert batch["results_url"] is None and batch["ended_at"] is None
        assert balance(service, acct.org_id).held > 0
        early = await http.get(f"{PATH}/{batch['id']}/results", headers=headers(acct))
        assert early.status_code == 409 and early.json()["error"]["code"] == "results_not_ready"

        await worker(service).run_until_idle()
        done = (await http.get(f"{PATH}/{batch['id']}", headers=headers(acct))).json()
        assert done["processing_status"] == "ended" and done["ended_at"]
        assert done["request_counts"]["succeeded"] == 4
        assert done["results_url"].endswith(f"/v1/messages/batches/{batch['id']}/results")
        out = await http.get(f"{PATH}/{batch['id']}/results", headers=headers(acct))
        # The same batch is an OpenAI file batch of /v1/messages lines underneath.
        same = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
    assert out.status_code == 200
    got = results(out.text)
    assert [x["custom_id"] for x in got] == [f"req-{i}" for i in range(4)]
    for x in got:
        assert x["result"]["type"] == "succeeded"
        message = x["result"]["message"]
        assert message["type"] == "message" and message["content"][0]["text"] == "hello there"
        assert message["stop_reason"] == "end_turn" and "charge" not in message
    assert engine.calls[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert same["endpoint"] == "/v1/messages" and same["status"] == "completed"
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == to_ticks(parse_money(same["charge"])) > 0
    assert service.db.read_sync(ledger.audit) == []


async def test_a_bad_request_refuses_the_whole_batch_naming_it(service):
    answer_with(service, "hi")
    acct = make_account(service, credit="1")
    bad = request("b", temperature=5)
    async with asgi_client(service, worker=False) as http:
        r = await http.post(PATH, json={"requests": [request("a"), bad]}, headers=headers(acct))
        dup = await http.post(
            PATH, json={"requests": [request("a"), request("a")]}, headers=headers(acct)
        )
        odd = await http.post(
            PATH, json={"requests": [request("no spaces!")]}, headers=headers(acct)
        )
        # A model nobody serves is Anthropic's 404 before any rule between fields.
        tool = {"name": "t", "input_schema": {"type": "object"}}
        unknown = request("c", model="claude-nope", tools=[tool])
        unknown["params"]["tool_choice"] = {"type": "tool", "name": "not-t"}
        nope = await http.post(
            PATH, json={"requests": [request("a"), unknown]}, headers=headers(acct)
        )
        listed = (await http.get(PATH, headers=headers(acct))).json()
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("requests.1")
    assert r.json()["error"]["param"].startswith("requests.1.params")
    assert dup.status_code == 400 and dup.json()["error"]["code"] == "duplicate_custom_id"
    assert odd.status_code == 400
    assert nope.status_code == 404 and nope.json()["error"]["type"] == "not_found_error"
    assert nope.json()["error"]["param"] == "requests.1.params.model"
    assert listed["data"] == [] and balance(service, acct.org_id).held == 0


async def test_without_credit_the_create_is_a_billing_error(service):
    answer_with(service, "hi")
    poor = make_account(service, "poor", credit="0")
    async with asgi_client(service, worker=False) as http:
        r = await http.post(PATH, json={"requests": [request("a")]}, headers=headers(poor))
    assert r.status_code == 402 and r.json()["error"]["type"] == "billing_error"


async def test_cancel_ends_unsent_requests_canceled(service):
    answer_with(service, "hi")
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        batch = (
            await http.post(
                PATH, json={"requests": [request(f"r{i}") for i in range(3)]}, headers=headers(acct)
            )
        ).json()
        c = await http.post(f"{PATH}/{batch['id']}/cancel", headers=headers(acct))
        assert c.status_code == 200 and c.json()["processing_status"] == "canceling"
        assert c.json()["cancel_initiated_at"]
        await worker(service).run_until_idle()
        done = (await http.get(f"{PATH}/{batch['id']}", headers=headers(acct))).json()
        out = await http.get(f"{PATH}/{batch['id']}/results", headers=headers(acct))
        again = await http.post(f"{PATH}/{batch['id']}/cancel", headers=headers(acct))
    assert done["processing_status"] == "ended" and done["request_counts"]["canceled"] == 3
    assert [x["result"] for x in results(out.text)] == [{"type": "canceled"}] * 3
    assert again.status_code == 200 and again.json()["processing_status"] == "ended"
    assert balance(service, acct.org_id).held == 0


async def test_list_pages_newest_first_with_after_and_before(service):
    answer_with(service, "hi")
    acct = make_account(service, credit="5")
    made = []
    async with asgi_client(service, worker=False) as http:
        for i in range(5):
            r = await http.post(PATH, json={"requests": [request(f"r{i}")]}, headers=headers(acct))
            made.append(r.json()["id"])
            service.clock.advance(1)
        first = (await http.get(f"{PATH}?limit=2", headers=headers(acct))).json()
        second = (
            await http.get(f"{PATH}?limit=2&after_id={first['last_id']}", headers=headers(acct))
        ).json()
        back = (
            await http.get(f"{PATH}?limit=2&before_id={second['first_id']}", headers=headers(acct))
        ).json()
        missing = await http.get(f"{PATH}/bat.nope", headers=headers(acct))
    newest = list(reversed(made))
    assert [b["id"] for b in first["data"]] == newest[:2] and first["has_more"] is True
    assert [b["id"] for b in second["data"]] == newest[2:4] and second["has_more"] is True
    assert [b["id"] for b in back["data"]] == newest[:2]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


async def test_an_inference_key_sees_only_its_own_and_a_read_key_cannot_create(service):
    answer_with(service, "hi")
    owner = make_account(service, "acme", credit="1")
    other = add_key(service, "acme", Scope.INFERENCE)
    reader = add_key(service, "acme", Scope.READ)
    async with asgi_client(service, worker=False) as http:
        batch = (
            await http.post(PATH, json={"requests": [request("a")]}, headers=headers(owner))
        ).json()
        theirs = await http.get(f"{PATH}/{batch['id']}", headers=headers(other))
        refused = await http.post(PATH, json={"requests": [request("a")]}, headers=headers(reader))
        read = await http.get(f"{PATH}/{batch['id']}", headers=headers(reader))
    assert theirs.status_code == 404
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert read.status_code == 200


async def test_a_worker_lost_mid_call_leaves_errored_uncertain_never_resent(service, clock):
    engine = BlockingEngine("late")
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        batch = (
            await http.post(
                PATH, json={"requests": [request(f"r{i}") for i in range(3)]}, headers=headers(acct)
            )
        ).json()
        crashed = worker(service, "wkr.crashed")
        await crashed.tick()
        await eventually(lambda: len(engine.calls) == 2)
        await crashed.stop()  # its calls are abandoned mid-flight, as a kill would
        clock.advance(61)
        engine.release.set()
        await worker(service, "wkr.next").run_until_idle()
        done = (await http.get(f"{PATH}/{batch['id']}", headers=headers(acct))).json()
        out = await http.get(f"{PATH}/{batch['id']}/results", headers=headers(acct))
    assert done["request_counts"]["errored"] == 2 and done["request_counts"]["succeeded"] == 1
    kinds = sorted(x["result"]["type"] for x in results(out.text))
    assert kinds == ["errored", "errored", "succeeded"]
    codes = [
        x["result"]["error"]["error"]["code"]
        for x in results(out.text)
        if x["result"]["type"] == "errored"
    ]
    assert codes == ["uncertain", "uncertain"]
    assert len(engine.calls) == 3
    charged = sum(row.charge or 0 for row in lines_of(service, batch["id"]))
    bal = balance(service, acct.org_id)
    assert bal.held == 0 and bal.settled == charged > 0


async def test_min_discount_is_kept_on_the_batch_underneath_and_checked(service):
    answer_with(service, "hi")
    acct = make_account(service, credit="1")
    async with asgi_client(service, worker=False) as http:
        r = await http.post(
            PATH, json={"requests": [request("a")], "min_discount": "30"}, headers=headers(acct)
        )
        bad = await http.post(
            PATH, json={"requests": [request("a")], "min_discount": 130}, headers=headers(acct)
        )
        same = (await http.get(f"/v1/batches/{r.json()['id']}", headers=acct.headers)).json()
    assert r.status_code == 200 and same["min_discount"] == 30
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "min_discount_out_of_range"
