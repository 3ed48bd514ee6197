"""A file for ``vllm run_batch`` runs unchanged here, and comes back in its line shape.

vLLM is not installable on this machine, so its documented format stands in:
the input line (``BatchRequestInput``: ``custom_id``, ``method``, ``url``,
``body``) and the output line (``BatchRequestOutput``: ``id``, ``custom_id``,
``response`` of ``status_code``, ``request_id`` and ``body``, and ``error``),
written here as strict models that refuse any other field. The example
lines are the ones vLLM's documentation gives, with the model name changed.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from tests.support.accounts import make_account
from tests.support.file_batches import create, upload, worker
from tests.support.server import asgi_client
from tests.support.workspace import answer_with

#: vLLM's documented example input (examples/offline_inference/openai_batch), model renamed.
VLLM_INPUT = """\
{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "kettei-core", "messages": [{"role": "system", "content": "You are a helpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}
{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "kettei-core", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},{"role": "user", "content": "Hello world!"}],"max_completion_tokens": 1000}}
"""  # noqa: E501


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BatchRequestInput(_Strict):
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchResponseData(_Strict):
    status_code: int = 200
    request_id: str
    body: dict[str, Any] | None = None


class BatchRequestOutput(_Strict):
    id: str
    custom_id: str
    response: BatchResponseData | None
    error: Any | None


async def test_a_vllm_run_batch_file_runs_unchanged_and_answers_in_its_shape(service):
    answer_with(service, "Hello! How can I help?")
    acct = make_account(service, credit="1")
    for line in VLLM_INPUT.splitlines():
        BatchRequestInput.model_validate_json(line)
    async with asgi_client(service, worker=False) as http:
        f = (await upload(http, acct.headers, VLLM_INPUT.encode())).json()
        batch = (await create(http, acct.headers, f["id"])).json()
        await worker(service).run_until_idle()
        done = (await http.get(f"/v1/batches/{batch['id']}", headers=acct.headers)).json()
        out = await http.get(f"/v1/files/{done['output_file_id']}/content", headers=acct.headers)
        back = await http.get(f"/v1/files/{f['id']}/content", headers=acct.headers)
    assert back.text == VLLM_INPUT  # stored byte for byte
    lines = [BatchRequestOutput.model_validate_json(x) for x in out.text.splitlines()]
    assert [x.custom_id for x in lines] == ["request-1", "request-2"]
    for x in lines:
        assert x.error is None and x.response is not None and x.response.status_code == 200
        assert x.response.body is not None
        assert x.response.body["choices"][0]["message"]["content"] == "Hello! How can I help?"
    # The output file is JSON Lines, one object per line, as run_batch writes it.
    assert all(json.loads(x) for x in out.text.splitlines())
