"""Following a batch inference run while it runs (``…/finished``): every row once, then ``ended``.

The engine answers one row at a time; the reader reads between answers, in
small pages from a cursor, and at the end has seen each row exactly once,
each as the run's failures show a row, with its answers while they wait in
the run (the same answers the dataset gets once they are written).
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select

from batchyard.client import AsyncClient
from batchyard.service import Service
from batchyard.store.runs import run_items
from tests.support.accounts import make_account
from tests.support.clocks import ReleasingClock
from tests.support.deferred_batches import eventually
from tests.support.following import read_pages
from tests.support.runs import FIELD_RUN as RUN
from tests.support.runs import Api, GatedEngine, RowEngine, fast_runs
from tests.support.server import asgi_client


def ended_rows(service: Service, run_id: str) -> int:
    q = select(func.count()).where(run_items.c.run_id == run_id, run_items.c.ended_seq.is_not(None))
    return int(service.db.read_sync(lambda c: c.execute(q).scalar_one()))


async def test_the_python_client_follows_a_run_row_by_row_to_its_end(make_service):
    service = make_service(runs=fast_runs())
    engine = RowEngine(gated=True)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="5")
    rows = [{"text": f"fail {i}" if i == 2 else f"row {i}"} for i in range(6)]

    async with asgi_client(service) as http:
        api = await Api(http, acct.headers).start()
        run_id, ds_id = await api.confirmed(rows, RUN)
        ticks = ReleasingClock(lambda: ended_rows(service, run_id), len(rows), engine.release)
        client = AsyncClient(
            base_url=str(http.base_url), api_key=acct.key, http_client=http, clock=ticks
        )
        followed = [x async for x in client.follow_run(api.project, run_id, poll=1.0)]
        done = await api.get(run_id)
        written = {r["id"]: r["data"] for r in await api.rows(ds_id)}

    assert done["status"] == "completed"
    assert sorted(x["rowId"] for x in followed) == [1, 2, 3, 4, 5, 6]  # each once
    by_row = {x["rowId"]: x for x in followed}
    assert by_row[3]["state"] == "failed" and by_row[3]["error"]["code"] == "model_output_invalid"
    assert by_row[3]["outputs"] is None
    answered = [x for x in followed if x["state"] == "succeeded"]
    assert len(answered) == 5
    # Read while the run ran, a row's answers are the ones the dataset gets when they are
    # written; read after that, the row says it was written (the run keeps no second copy).
    early = [x for x in answered if x["outputs"] is not None]
    assert early and all(not x["written"] for x in early)
    for x in answered:
        if x["outputs"] is not None:
            assert x["outputs"] == [written[x["rowId"]]["answer"]]
        else:
            assert x["written"] is True
    assert all(x["updatedAt"].endswith("Z") for x in followed)


@pytest.mark.parametrize("postgres", [False, True], ids=["sqlite", "postgresql"])
async def test_a_run_read_in_pages_gives_each_row_once_canceled_ones_included(
    make_service, postgres
):
    service = make_service(runs=fast_runs(concurrency=2), postgres=postgres)
    engine = GatedEngine(open_first=2)
    service.engines.set("embedded", engine)
    acct = make_account(service, credit="5")
    rows = [{"text": f"row {i}"} for i in range(12)]
    async with asgi_client(service) as http:
        api = await Api(http, acct.headers).start()
        run_id, _ = await api.confirmed(rows, RUN)
        path = f"{api.runs}/{run_id}/finished"
        await eventually(lambda: ended_rows(service, run_id) >= 2)
        first, cursor, ended = await read_pages(http, path, acct.headers, "0", limit=1)
        assert not ended and len(first) >= 2
        again, same_cursor, _ = await read_pages(http, path, acct.headers, cursor, limit=1)
        assert again == [] and same_cursor == cursor  # nothing new: nothing twice

        canceled = await api.post(run_id, "cancel")
        assert canceled.status_code == 200, canceled.text
        engine.gate.set()  # the calls in flight land
        await api.wait(run_id, "canceled")
        rest, _, ended = await read_pages(http, path, acct.headers, cursor, limit=5)

        bad = await http.get(path, params={"after": "x"}, headers=acct.headers)
        unknown = await http.get(path, params={"since": "0"}, headers=acct.headers)
        other = make_account(service, "globex", credit="1")
        hidden = await http.get(path, headers=other.headers)

    assert ended
    seen = [x["rowId"] for x in first + rest]
    assert sorted(seen) == list(range(1, 13))  # every row exactly once
    states = json.dumps(sorted({x["state"] for x in first + rest}))
    assert "canceled" in states and "succeeded" in states
    assert all(x["outputs"] is None for x in first + rest if x["state"] == "canceled")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_cursor"
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "unsupported_parameter"
    assert hidden.status_code == 404
