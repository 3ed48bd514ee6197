"""Model versions uploaded into a project: kept only when sound, served as the fine-tune itself.

The adapter is ``tests/data/smollm2-sentiment-lora.gguf``, a rank-8 LoRA for the
embedded SmolLM2-135M-Instruct made by ``scripts/train_lora.py`` (its docstring
has the command and the data). At temperature 0 the version's answers must be
exactly what llama-cpp-python gives with the same adapter loaded directly
(``Llama(model_path, lora_path=…)``), and not what the base gives.
"""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchyard.core.accounts import Scope
from batchyard.core.catalog import default_catalog
from batchyard.core.decisions import SYSTEM_PROMPT
from batchyard.core.sections import VersionSettings
from batchyard.engines.model_files import default_model_path
from batchyard.service.model_versions import folder_of
from batchyard.store import model_versions as store
from tests.support.accounts import add_key, make_account
from tests.support.gguf import F32, I32, gguf_bytes, lora_for
from tests.support.runs import Api, fast_runs
from tests.support.server import asgi_client
from tests.support.waits import settles, until

pytestmark = pytest.mark.model

ADAPTER = Path(__file__).resolve().parents[2] / "data" / "smollm2-sentiment-lora.gguf"
Q = "blk.0.attn_q.weight"
# Decide rounds its probabilities to six places; read on an engine whose cache holds
# nothing else, they are llama-cpp-python's own to that rounding. (The same prompt read
# beside other cached prompts lands in other cells of the shared cache, and llama.cpp's
# CPU kernels then sum in another order: the 4-bit model's int8-quantized activations
# turn those last-bit differences into up to ~0.03 of probability. So each comparison
# below starts from an engine with nothing cached.)
TOLERANCE = 1e-6

DECISION = {
    "id": "sentiment",
    "question": "How does the writer feel?",
    "outcomes": [
        {"id": "positive", "description": "pleased"},
        {"id": "negative", "description": "unhappy"},
        {"id": "neutral", "description": "neither"},
    ],
}
TEXT = "The update broke my phone again, third time this month."
CHAT = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {
        "role": "user",
        "content": "Questions:\nsentiment: How does the writer feel?\n  - positive: pleased\n"
        "  - negative: unhappy\n  - neutral: neither\n\n"
        "Reply with one line per question, in this order and nothing else:\n"
        "sentiment: <answer id>\n\nText:\nMeh. It arrived.",
    },
]


@pytest.fixture
def svc(make_service):
    # One sequence at a time: each answer is then computed exactly as llama-cpp-python
    # computes it alone. Beside other sequences a near-tied greedy pick may flip (the
    # batch changes the float order of the output layer; see test_llama_scheduler.py).
    return make_service(runs=fast_runs(), embedded_slots=1)


async def upload(
    http: httpx.AsyncClient,
    headers: dict[str, str],
    project: str,
    data: bytes,
    *,
    filename: str = "adapter.gguf",
    **fields: str,
) -> httpx.Response:
    form = {"base": "kettei-core", "type": "lora", **fields}
    return await http.post(
        f"/v1/projects/{project}/models",
        data=form,
        files={"file": (filename, data, "application/octet-stream")},
        headers=headers,
    )


def left_behind(svc) -> tuple[list[str], int]:
    """Files in the version folder and rows in the table: what a refused upload must not leave."""
    folder = folder_of(svc)
    files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    rows = svc.db.read_sync(lambda c: c.execute(store.model_versions.select()).fetchall())
    return files, len(rows)


def direct_llama(lora: bool) -> Any:
    import llama_cpp

    extra = {"lora_path": str(ADAPTER)} if lora else {}
    # The engine's settings: its n_ctx, and flash attention as its scheduler runs it.
    return llama_cpp.Llama(
        str(default_model_path()),
        n_ctx=2048,
        flash_attn=True,
        verbose=False,
        **extra,
    )


async def test_an_adapter_is_uploaded_listed_shown_scoped_and_deleted(svc) -> None:
    acct = make_account(svc, credit="5")
    reader = add_key(svc, "acme", Scope.READ)
    inference = add_key(svc, "acme", Scope.INFERENCE)
    other = make_account(svc, "rival", credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        r = await upload(http, acct.headers, api.project, ADAPTER.read_bytes(), name="sentiment")
        assert r.status_code == 201, r.text
        mv = r.json()
        assert mv["id"].startswith("mv.") and mv["object"] == "model_version"
        assert (mv["type"], mv["base"], mv["name"], mv["status"]) == (
            "lora",
            "kettei-core",
            "sentiment",
            "ready",
        )
        assert mv["bytes"] == ADAPTER.stat().st_size and mv["created_at"]
        path = f"/v1/projects/{api.project}/models"
        listed = (await http.get(path, headers=reader.headers)).json()["data"]
        assert [v["id"] for v in listed] == [mv["id"]]
        assert (await http.get(f"{path}/{mv['id']}", headers=reader.headers)).json() == mv
        # Read keys read, inference keys only use: neither uploads.
        for key in (reader, inference):
            refused = await upload(http, key.headers, api.project, ADAPTER.read_bytes())
            assert refused.status_code == 403, refused.text
        assert (await http.get(path, headers=inference.headers)).status_code == 403
        # Another organisation: the project, the version and the model name are 404.
        assert (await http.get(f"{path}/{mv['id']}", headers=other.headers)).status_code == 404
        models = (await http.get("/v1/models", headers=other.headers)).json()["data"]
        assert mv["id"] not in [m["id"] for m in models]
        chat = {"model": mv["id"], "messages": CHAT, "max_tokens": 4, "temperature": 0}
        theirs = await http.post("/v1/chat/completions", json=chat, headers=other.headers)
        assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "model_not_found"
        # /v1/models tells the truth about it to its owner.
        mine = (await http.get(f"/v1/models/{mv['id']}", headers=inference.headers)).json()
        assert mine["available"] is True and mine["type"] == "version"
        assert mine["base_model"] == "kettei-core" and mine["project_id"] == api.project
        assert mine["capabilities"]["chat"] and mine["capabilities"]["scoring"]
        assert mine["loaded"] is False
        used = await http.post("/v1/chat/completions", json=chat, headers=inference.headers)
        assert used.status_code == 200, used.text
        assert (await http.get(f"/v1/models/{mv['id']}", headers=acct.headers)).json()["loaded"]
        deleted = await http.delete(f"{path}/{mv['id']}", headers=acct.headers)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert (await http.get(f"{path}/{mv['id']}", headers=acct.headers)).status_code == 404
        gone = await http.post("/v1/chat/completions", json=chat, headers=acct.headers)
        assert gone.status_code == 404
    assert left_behind(svc)[0] == []


async def fresh(svc) -> None:
    """Nothing cached: the base model (and its adapters) unloaded, loaded again on use."""
    await svc.engines.embedded().unload_version(None)


async def fresh_answers(
    svc, http: httpx.AsyncClient, headers: dict[str, str], models: tuple[str, ...]
) -> dict[str, tuple[str, dict[str, float]]]:
    """Each model's decide probabilities (uncalibrated) and greedy chat answer, each read
    on an engine with nothing cached (see ``TOLERANCE``): the chat asks the decide's
    questions, so it would otherwise start from the decide's cached prefix."""
    answers: dict[str, tuple[str, dict[str, float]]] = {}
    for model in models:
        await fresh(svc)
        body = {"model": model, "input": {"text": TEXT}, "decisions": [DECISION]}
        d = await http.post("/v1/decide", json={**body, "calibration": "none"}, headers=headers)
        assert d.status_code == 200, d.text
        assert d.json()["fallback"] is None
        await fresh(svc)
        chat = {"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0}
        r = await http.post("/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 200, r.text
        answers[model] = (
            r.json()["choices"][0]["message"]["content"],
            d.json()["answers"][0]["probabilities"],
        )
    return answers


def direct_answers(llm: Any) -> tuple[str, dict[str, float]]:
    """llama-cpp-python's own chat answer and decide probabilities, the same settings."""
    try:
        out = llm.create_chat_completion(messages=CHAT, max_tokens=24, temperature=0)
        return str(out["choices"][0]["message"]["content"]), _direct_probs(llm)
    finally:
        llm.close()


async def test_the_versions_answers_are_the_adapters_own_not_the_bases(svc) -> None:
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        mv = (await upload(http, acct.headers, api.project, ADAPTER.read_bytes())).json()["id"]
        answers = await fresh_answers(svc, http, acct.headers, (mv, "kettei-core"))
    tuned, base = answers[mv], answers["kettei-core"]
    # llama-cpp-python's own answers, the adapter loaded directly, the same settings.
    loop = asyncio.get_running_loop()
    for lora, (text, probs) in ((True, tuned), (False, base)):
        own_text, own_probs = await loop.run_in_executor(
            None, lambda lora=lora: direct_answers(direct_llama(lora))
        )
        assert text == own_text
        # The same numbers, read the same way, to decide's six places.
        for outcome, p in own_probs.items():
            assert math.isclose(probs[outcome], p, abs_tol=TOLERANCE), (lora, probs, own_probs)
    moved = max(abs(tuned[1][o] - base[1][o]) for o in base[1])
    assert moved > 0.05, (tuned, base)
    assert tuned[0] != base[0], (tuned, base)


def _direct_probs(llm: Any) -> dict[str, float]:
    """Decide's three-way answer from llama-cpp-python alone: each reply's log-probability.

    As decide reads it: the prompt evaluated once, then each reply's tokens in
    one batch after it, every position's logits read from llama.cpp.
    """
    import numpy as np

    from batchyard.core import decisions as rules
    from batchyard.engines.tokenizers import ChatTemplate

    req = rules.parse_request({"model": "x", "input": {"text": TEXT}, "decisions": [DECISION]})
    template = ChatTemplate.from_llama(llm)
    assert template is not None
    prompt = template.prompt(rules.build_messages(req, "lines")).encode()
    p_tokens = llm.tokenize(prompt, add_bos=False, special=True)
    n_prompt, n_vocab = len(p_tokens), llm.n_vocab()

    def logprob(row: Any, token: int) -> float:
        row = row.astype(np.float64)
        peak = float(row.max())
        return float(row[token] - peak - np.log(np.exp(row - peak).sum()))

    llm.reset()
    llm.eval(p_tokens)
    after_prompt = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()
    scores = []
    for candidate in rules.scoring_candidates(req.decisions)[0]:
        full = llm.tokenize(prompt + candidate.encode(), add_bos=False, special=True)
        assert full[:n_prompt] == p_tokens
        tokens = full[n_prompt:]
        total = logprob(after_prompt, tokens[0])
        feed = tokens[:-1]
        if feed:
            llm._ctx.kv_cache_seq_rm(-1, n_prompt, -1)
            llm._batch.set_batch(feed, n_past=n_prompt, logits_all=True)
            llm._ctx.decode(llm._batch)
            rows = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(feed), n_vocab))
            total += sum(logprob(rows[j], tokens[j + 1]) for j in range(len(feed)))
        scores.append(total)
    probs = rules.softmax(scores)
    return {o["id"]: p for o, p in zip(DECISION["outcomes"], probs, strict=True)}


async def test_a_batch_inference_run_on_the_version_writes_the_adapters_answers(svc) -> None:
    acct = make_account(svc, credit="5")
    rows = [{"text": t} for t in ("Meh. It arrived.", "Best purchase ever!", "It broke.")]
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        mv = (await upload(http, acct.headers, api.project, ADAPTER.read_bytes())).json()["id"]
        body = {
            "model": {"type": "version", "id": mv},
            "input": {"type": "field", "field": "text"},
            "output": {"type": "field", "field": "answer"},
            "sampling": {"maxOutputTokens": 12, "temperature": 0},
        }
        run_id, ds = await api.confirmed(rows, body)
        busy = await http.delete(f"/v1/projects/{api.project}/models/{mv}", headers=acct.headers)
        assert busy.status_code in (200, 409)
        if busy.status_code == 409:
            assert busy.json()["error"]["code"] == "model_version_in_use"
        done = await api.wait(run_id, "completed")
        written = [r["data"]["answer"] for r in await api.rows(ds)]
    assert done["results"]["rowsSucceeded"] == 3
    loop = asyncio.get_running_loop()

    def direct() -> list[str]:
        llm = direct_llama(True)
        try:
            return [
                llm.create_chat_completion(
                    messages=[{"role": "user", "content": r["text"]}],
                    max_tokens=12,
                    temperature=0,
                )["choices"][0]["message"]["content"]
                for r in rows
            ]
        finally:
            llm.close()

    assert written == await loop.run_in_executor(None, direct)


async def test_a_version_in_use_by_a_live_run_cannot_be_deleted(svc) -> None:
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        mv = (await upload(http, acct.headers, api.project, ADAPTER.read_bytes())).json()["id"]
        ds = await api.upload([{"text": "hello"}])
        created = await api.create(
            {
                "datasetId": ds["id"],
                "model": {"type": "version", "id": mv},
                "input": {"type": "field", "field": "text"},
                "output": {"type": "field", "field": "answer"},
                "sampling": {"maxOutputTokens": 4},
            }
        )
        assert created.status_code == 201, created.text
        r = await http.delete(f"/v1/projects/{api.project}/models/{mv}", headers=acct.headers)
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_version_in_use"
        await api.post(created.json()["id"], "cancel")
        await api.wait(created.json()["id"], "canceled")
        r = await http.delete(f"/v1/projects/{api.project}/models/{mv}", headers=acct.headers)
        assert r.status_code == 200, r.text


HOSTILE = {
    "not-gguf": (b"<html>not a model</html>" * 10, {}, "adapter.gguf", "not_gguf"),
    "truncated": (None, {}, "adapter.gguf", "invalid_model_file"),
    "other-architecture": (
        lora_for("qwen2", {Q: ((576, 8), (8, 576))}),
        {},
        "adapter.gguf",
        "lora_base_mismatch",
    ),
    "wrong-shapes": (
        lora_for("llama", {Q: ((576, 8), (8, 192))}),
        {},
        "adapter.gguf",
        "lora_base_mismatch",
    ),
    "huge-declared-tensor": (
        gguf_bytes(
            {"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora"},
            [(f"{Q}.lora_a", (576, 1 << 30), F32), (f"{Q}.lora_b", (1 << 30, 576), F32)],
            declared_bytes={f"{Q}.lora_a": 64, f"{Q}.lora_b": 64},
        ),
        {},
        "adapter.gguf",
        "invalid_model_file",
    ),
    "path-in-name": (
        lora_for("llama", {Q: ((576, 8), (8, 576))}),
        {"name": "../../etc/passwd"},
        "adapter.gguf",
        "invalid_name",
    ),
    "path-in-filename": (
        lora_for("llama", {Q: ((576, 8), (8, 576))}),
        {},
        "../../../tmp/evil.gguf",
        "invalid_name",
    ),
    "weights-as-lora": (
        gguf_bytes({"general.architecture": "llama", "general.type": "model"}, [("x", (32,), F32)]),
        {"type": "lora"},
        "model.gguf",
        "not_a_lora",
    ),
    "alpha-not-a-32-bit-float": (
        lora_for("llama", {Q: ((576, 8), (8, 576))}, extra={"adapter.lora.alpha": 16}),
        {},
        "adapter.gguf",
        "invalid_model_file",
    ),
    "activated-lora": (
        lora_for(
            "llama",
            {Q: ((576, 8), (8, 576))},
            extra={"adapter.alora.invocation_tokens": [1, 2]},
        ),
        {},
        "adapter.gguf",
        "alora_unsupported",
    ),
    "tensors-out-of-order": (
        lora_for("llama", {Q: ((576, 8), (8, 576))}, offsets={f"{Q}.lora_a": 18432}),
        {},
        "adapter.gguf",
        "invalid_model_file",
    ),
    "lora-for-a-tensor-the-base-lacks": (
        lora_for("llama", {"blk.99.attn_q.weight": ((576, 8), (8, 576))}),
        {},
        "adapter.gguf",
        "lora_base_mismatch",
    ),
    # Both pass llama.cpp's load and then abort the process at the first decode.
    "embedding-lora-on-tied-output": (
        lora_for("llama", {"token_embd.weight": ((8, 49152), (8, 576))}),
        {},
        "adapter.gguf",
        "lora_base_mismatch",
    ),
    "integer-lora-tensors": (
        gguf_bytes(
            {"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora"},
            [(f"{Q}.lora_a", (576, 8), I32), (f"{Q}.lora_b", (8, 576), I32)],
        ),
        {},
        "adapter.gguf",
        "invalid_model_file",
    ),
    "unknown-type": (b"GGUF", {"type": "qlora"}, "a.gguf", "invalid_model_type"),
    "unknown-base": (b"GGUF", {"base": "gpt-9"}, "a.gguf", "unknown_model"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_uploads_are_refused_with_a_code_and_leave_nothing(svc, case) -> None:
    data, fields, filename, code = HOSTILE[case]
    if case == "truncated":
        data = ADAPTER.read_bytes()[: ADAPTER.stat().st_size // 2]
    acct = make_account(svc, credit="1")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        r = await upload(http, acct.headers, api.project, data, filename=filename, **fields)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["code"] == code, r.text
    assert left_behind(svc) == ([], 0)


async def test_the_size_limit_is_configurable_and_coded(make_service) -> None:
    svc = make_service(model_versions=VersionSettings(max_lora_bytes=1024))
    acct = make_account(svc, credit="1")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        r = await upload(http, acct.headers, api.project, ADAPTER.read_bytes())
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    assert left_behind(svc) == ([], 0)


async def test_a_file_changed_at_rest_is_refused_not_served(make_service) -> None:
    first = make_service()
    acct = make_account(first, credit="1")
    async with asgi_client(first) as http:
        api = await Api(http, acct.headers).start()
        mv = (await upload(http, acct.headers, api.project, ADAPTER.read_bytes())).json()["id"]
    kept = folder_of(first) / f"{mv}.gguf"
    kept.write_bytes(kept.read_bytes()[:-1] + b"\x01")
    # Another process, which has not seen the version yet, checks it before serving it.
    second = make_service(catalog=default_catalog())
    async with asgi_client(second) as http:
        chat = {"model": mv, "messages": CHAT, "max_tokens": 2}
        r = await http.post("/v1/chat/completions", json=chat, headers=acct.headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_version_corrupt"


async def test_full_weights_are_served_as_a_model_of_their_own(svc) -> None:
    """The embedded GGUF uploaded as ``weights``: its own file, its own tokenizer, its answers."""
    acct = make_account(svc, credit="5")
    weights = default_model_path()
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        r = await upload(
            http, acct.headers, api.project, weights.read_bytes(), filename="w.gguf", type="weights"
        )
        assert r.status_code == 201, r.text
        mv = r.json()
        assert (mv["type"], mv["architecture"], mv["bytes"]) == (
            "weights",
            "llama",
            weights.stat().st_size,
        )
        est = await http.post(
            "/v1/decide/estimate",
            json={"model": mv["id"], "input": {"text": TEXT}, "decisions": [DECISION]},
            headers=acct.headers,
        )
        base_est = await http.post(
            "/v1/decide/estimate",
            json={"model": "kettei-core", "input": {"text": TEXT}, "decisions": [DECISION]},
            headers=acct.headers,
        )
        assert est.status_code == 200, est.text
        # Counted with the version's own tokenizer, which here is the base's vocabulary.
        assert est.json()["input_tokens"] == base_est.json()["input_tokens"]
        chat = {"model": mv["id"], "messages": CHAT, "max_tokens": 24, "temperature": 0}
        answer = await http.post("/v1/chat/completions", json=chat, headers=acct.headers)
        assert answer.status_code == 200, answer.text
    kept = folder_of(svc) / f"{mv['id']}.gguf"
    loop = asyncio.get_running_loop()

    def direct() -> str:
        import llama_cpp

        llm = llama_cpp.Llama(str(kept), n_ctx=2048, flash_attn=True, verbose=False)
        try:
            out = llm.create_chat_completion(messages=CHAT, max_tokens=24, temperature=0)
            return str(out["choices"][0]["message"]["content"])
        finally:
            llm.close()

    assert answer.json()["choices"][0]["message"]["content"] == await loop.run_in_executor(
        None, direct
    )


# -- warming with a real load ---------------------------------------------------------------


async def test_an_evicted_version_warms_with_a_real_load_and_keep_warm_holds_it(
    make_service,
) -> None:
    """Warming: idle time on the clock, the loads real (the adapter on the base).

    The engine loads on one thread; holding that thread with a blocker keeps a real
    load pending while the clock passes the 10-second fallback.
    """
    svc = make_service(model_versions=VersionSettings(idle_s=60), embedded_slots=1)
    engine = svc.engines.embedded()
    acct = make_account(svc, credit="5")
    body = {"input": {"text": TEXT}, "decisions": [DECISION], "calibration": "none"}

    held: list[threading.Event] = []

    def blocked() -> threading.Event:
        release = threading.Event()
        held.append(release)
        engine._loader.submit(release.wait)
        return release

    try:
        await _warming(svc, engine, acct, body, blocked)
    finally:
        for release in held:  # a failed check must not leave the loading thread held
            release.set()


async def _warming(svc: Any, engine: Any, acct: Any, body: dict[str, Any], blocked: Any) -> None:
    clock = svc.clock
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        mv = (await upload(http, acct.headers, api.project, ADAPTER.read_bytes())).json()["id"]

        async def decide() -> dict[str, Any]:
            r = await http.post("/v1/decide", json={**body, "model": mv}, headers=acct.headers)
            assert r.status_code == 200, r.text
            return dict(r.json())

        async def shown() -> dict[str, Any]:
            return dict((await http.get(f"/v1/models/{mv}", headers=acct.headers)).json())

        # Cold: the first call waits for the real load (the clock never reaches 10 s).
        assert (await shown())["loaded"] is False
        assert (await decide())["fallback"] is None
        assert engine.is_loaded(mv) and (await shown())["warm"]["state"] == "warm"
        # Idle past idle_s: the sweep evicts it, and /v1/models says so.
        clock.advance(61)
        await svc.warmth.sweep()
        view = await shown()
        assert view["loaded"] is False and view["warm"]["state"] == "cold"
        # Evicted, with its load held up: after 10 s the base answers, model_warming.
        release = blocked()
        first = asyncio.create_task(decide())
        await until(lambda: svc.warmth._versions[mv].loading is not None, "the load to start")
        clock.advance(10)
        fell_back = await first
        assert fell_back["fallback"] == {"reason": "model_warming", "model": "kettei-core"}
        # The load goes on, for real, once the thread is free; then the version answers.
        release.set()
        await until(lambda: engine.is_loaded(mv), "the version to load")
        assert (await decide())["fallback"] is None
        # Keep-warm: past idle_s the sweep leaves it loaded, and with the loading
        # thread held the next call is still answered by the version at once.
        kept = await http.post(
            f"/v1/models/{mv}/keep-warm", json={"minutes": 30}, headers=acct.headers
        )
        assert kept.status_code == 200 and kept.json()["warm"]["state"] == "warm"
        clock.advance(600)
        await svc.warmth.sweep()
        assert engine.is_loaded(mv)
        release = blocked()
        try:
            answered = await settles(decide())
        finally:
            release.set()
        assert answered["fallback"] is None
        # Past the window it goes cold; keep-warm on a cold version starts a real load.
        clock.advance(1800)
        await svc.warmth.sweep()
        assert not engine.is_loaded(mv)
        again = await http.post(
            f"/v1/models/{mv}/keep-warm", json={"minutes": 5}, headers=acct.headers
        )
        assert again.json()["warm"]["state"] in ("loading", "warm")
        await until(lambda: engine.is_loaded(mv), "keep-warm's load")
        assert (await decide())["fallback"] is None


# -- deletes seen by every process ---------------------------------------------------------


async def test_a_delete_through_one_process_is_refused_by_another_and_frees_its_adapter(
    make_service,
) -> None:
    """Two services on one database and one version folder: two API processes."""
    one = make_service(embedded_slots=1)
    two = make_service(catalog=default_catalog(), embedded_slots=1)
    acct = make_account(one, credit="5")
    chat = {"messages": CHAT, "max_tokens": 2, "temperature": 0}
    async with asgi_client(one) as a, asgi_client(two) as b:
        api = await Api(a, acct.headers).start()
        first, second = [
            (await upload(a, acct.headers, api.project, ADAPTER.read_bytes())).json()["id"]
            for _ in range(2)
        ]
        for mv in (first, second):
            used = await b.post(
                "/v1/chat/completions", json={**chat, "model": mv}, headers=acct.headers
            )
            assert used.status_code == 200, used.text
        engine_two = two.engines.embedded()
        assert sorted(engine_two.loaded_versions()) == sorted([first, second])
        for mv in (first, second):
            gone = await a.delete(f"/v1/projects/{api.project}/models/{mv}", headers=acct.headers)
            assert gone.status_code == 200, gone.text
        # The other process refuses the deleted version on its next use, and frees it.
        refused = await b.post(
            "/v1/chat/completions", json={**chat, "model": first}, headers=acct.headers
        )
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert first not in engine_two.loaded_versions()
        # A version it holds but nobody names is freed by its idle sweep, and is out of
        # its /v1/models at once.
        listed = (await b.get("/v1/models", headers=acct.headers)).json()["data"]
        assert second not in [m["id"] for m in listed]
        await two.warmth.sweep()
        assert engine_two.loaded_versions() == []
        for path in (f"/v1/models/{second}",):
            assert (await b.get(path, headers=acct.headers)).status_code == 404
        # Decide refuses it as the deleting process itself does (decide's unknown_model).
        ask = {"model": second, "input": {"text": TEXT}, "decisions": [DECISION]}
        here = await a.post("/v1/decide", json=ask, headers=acct.headers)
        there = await b.post("/v1/decide", json=ask, headers=acct.headers)
        assert there.status_code == here.status_code == 404, there.text
        assert there.json()["error"]["code"] == here.json()["error"]["code"] == "unknown_model"


# -- full weights, made here from the adapter ---------------------------------------------


@pytest.fixture(scope="session")
def merged_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base GGUF with the test adapter merged into its weights (scripts/merge_lora.py).

    A real full-weights fine-tune of the embedded model, made in a few seconds
    (about 2 s of CPU; 105 MB, so made per session rather than committed).
    """
    from scripts.merge_lora import merge

    out = tmp_path_factory.mktemp("weights") / "smollm2-sentiment-merged.gguf"
    assert merge(default_model_path(), ADAPTER, out) == 40
    return out


async def test_full_weights_answer_as_llama_cpp_python_with_that_gguf_and_not_as_the_base(
    svc, merged_weights
) -> None:
    acct = make_account(svc, credit="5")
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        r = await upload(
            http,
            acct.headers,
            api.project,
            merged_weights.read_bytes(),
            filename="merged.gguf",
            type="weights",
        )
        assert r.status_code == 201, r.text
        mv = r.json()["id"]
        answers = await fresh_answers(svc, http, acct.headers, (mv, "kettei-core"))
        engine = svc.engines.embedded()
        # Its own model and scheduler, not an adapter on the base.
        assert engine._states[mv].model is not None and engine._states[mv].adapter is None
    kept = folder_of(svc) / f"{mv}.gguf"
    loop = asyncio.get_running_loop()

    def direct() -> tuple[str, dict[str, float]]:
        import llama_cpp

        return direct_answers(
            llama_cpp.Llama(str(kept), n_ctx=2048, flash_attn=True, verbose=False)
        )

    own_text, own_probs = await loop.run_in_executor(None, direct)
    text, probs = answers[mv]
    assert text == own_text
    for outcome, p in own_probs.items():
        assert math.isclose(probs[outcome], p, abs_tol=TOLERANCE), (probs, own_probs)
    base_text, base_probs = answers["kettei-core"]
    assert text != base_text
    assert max(abs(probs[o] - base_probs[o]) for o in probs) > 0.05


# -- an adapter made elsewhere ---------------------------------------------------------


def _outside_adapter(path: Path, kind: str) -> Path:
    """A LoRA GGUF written as llama.cpp's convert_lora_to_gguf.py writes one (gguf-py's
    writer, its keys), here with small random weights: another writer than ours.

    It adapts the attention of the last three blocks, in ``kind`` (f32, f16 or q8_0).
    """
    import gguf
    import numpy as np

    rng = np.random.default_rng(7)
    rank = 32  # whole Q8_0 blocks in lora_b's rows too
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("general.name", "outside")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 32.0)
    qtype = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[kind]

    def add(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.15).astype(np.float32)
        if kind == "f16":
            values = values.astype(np.float16)
        data = gguf.quantize(values, qtype) if kind == "q8_0" else values
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    for block in (27, 28, 29):
        for target, out in (("attn_q", 576), ("attn_v", 192)):
            add(f"blk.{block}.{target}.weight.lora_a", rank, 576)  # ne [576, rank]
            add(f"blk.{block}.{target}.weight.lora_b", out, rank)  # ne [rank, out]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
async def test_an_adapter_made_elsewhere_uploads_and_answers_as_llama_cpp_python(
    svc, tmp_path, kind
) -> None:
    adapter = _outside_adapter(tmp_path / f"outside-{kind}.gguf", kind)
    acct = make_account(svc, credit="5")
    messages = [{"role": "user", "content": "Name three colours."}]
    async with asgi_client(svc) as http:
        api = await Api(http, acct.headers).start()
        r = await upload(http, acct.headers, api.project, adapter.read_bytes())
        assert r.status_code == 201, r.text
        mv = r.json()["id"]
        answers = {}
        for model in (mv, "kettei-core"):
            await fresh(svc)
            chat = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
            c = await http.post("/v1/chat/completions", json=chat, headers=acct.headers)
            assert c.status_code == 200, c.text
            answers[model] = c.json()["choices"][0]["message"]["content"]
    loop = asyncio.get_running_loop()

    def direct() -> str:
        import llama_cpp

        llm = llama_cpp.Llama(
            str(default_model_path()),
            n_ctx=2048,
            flash_attn=True,
            verbose=False,
            lora_path=str(adapter),
        )
        try:
            out = llm.create_chat_completion(messages=messages, max_tokens=16, temperature=0)
            return str(out["choices"][0]["message"]["content"])
        finally:
            llm.close()

    assert answers[mv] == await loop.run_in_executor(None, direct)
    assert answers[mv] != answers["kettei-core"]
