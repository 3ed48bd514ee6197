"""The embedded engine's scheduler on the real SmolLM2 GGUF: batching, prefixes, cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from batchyard.engines.llama_cpp import LlamaCppEngine
from batchyard.engines.model_files import default_model_path
from batchyard.engines.protocol import Completion, CompletionRequest, Delta

pytestmark = [pytest.mark.model, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three fruits.",
    "Explain gravity to a child.",
    "What is 12 times 7?",
    "Name a famous painter.",
    "Describe the ocean in one sentence.",
    "Give me a tip for learning Python.",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[LlamaCppEngine]:
    eng = LlamaCppEngine(default_model_path(), n_ctx=512, slots=8)
    await eng.load()
    yield eng
    await eng.aclose()


async def _all_in_one_step(engine: LlamaCppEngine, calls: list[Any]) -> list[Any]:
    """Run ``calls`` with the step thread held until all are queued: one admission step.

    Otherwise how many join the first step depends on thread timing, and with it
    which prompts are read in one micro-batch (which rounds differently): the
    same test would see a different batch each run.
    """
    steps = engine._states[None].model.steps  # type: ignore[union-attr]
    inside, go = threading.Event(), threading.Event()

    def hold() -> None:
        inside.set()
        go.wait()

    held_step = asyncio.ensure_future(steps.call(hold))
    await asyncio.to_thread(inside.wait)
    gathered = asyncio.gather(*calls)
    while len(steps._inbox) < len(calls):
        await asyncio.sleep(0)
    go.set()
    await held_step
    return list(await gathered)


def ask(text: str, max_tokens: int = 16, **options: object) -> CompletionRequest:
    messages = [{"role": "user", "content": text}]
    return CompletionRequest("smollm2", messages, max_tokens, **options)  # type: ignore[arg-type]


async def test_greedy_answers_alone_and_beside_seven_others(engine: LlamaCppEngine) -> None:
    """At temperature 0, most answers are the same alone and batched; the rest part at a tie.

    Why not all (``bench/batch_invariance.py`` shows each cause on llama.cpp
    directly): a prompt read in the same step as seven others fills a
    micro-batch of 64 rows or more, which llama.cpp's CPU flash attention
    tiles, while alone it goes row by row, and the two round differently
    (up to 0.83 in a logit on the next token); and the row-by-row kernel
    sums a sequence's cells in the order they sit in the shared cache, which
    depends on what else ran. Decoding beside other rows changes nothing by
    itself. ``llama-server`` (a KV stream per slot) agrees 8 of 8; see
    docs/explanation/batch-invariance.md. All eight join one step (the step
    thread is held until they are queued), so the batch is the same every run.
    """
    requests = [ask(p, temperature=0.0, logprobs=True, top_logprobs=2) for p in PROMPTS]
    alone = [await engine.complete(r) for r in requests]
    together = await _all_in_one_step(engine, [engine.complete(r) for r in requests])
    agree = sum(a.text == b.text for a, b in zip(alone, together, strict=True))
    print(f"batched vs alone at temperature 0: {agree}/{len(PROMPTS)} identical")
    assert agree >= len(PROMPTS) // 2
    for a, b in zip(alone, together, strict=True):
        assert a.usage.output_tokens > 0 and b.usage.output_tokens > 0
        assert a.usage.input_tokens == b.usage.input_tokens
        if a.text == b.text:
            continue
        # Where they differ, they part where the model was torn between two tokens
        # (a rounding difference flipped a near tie): the batched answer's token
        # there was the lone answer's second choice, within a nat of its first.
        mine, theirs = a.choices[0].logprobs or [], b.choices[0].logprobs or []
        k = next(
            i
            for i, (x, y) in enumerate(zip(mine, theirs, strict=False))
            if x["token"] != y["token"]
        )
        first, second = mine[k]["top_logprobs"][:2]
        assert theirs[k]["token"] == second["token"], (a.text, b.text, mine[k])
        assert first["logprob"] - second["logprob"] < 1.0, (a.text, b.text, mine[k])


async def test_a_repeated_prompt_is_read_from_the_cache(engine: LlamaCppEngine) -> None:
    question = ask("Which planet is the largest?", max_tokens=2, temperature=0.0)
    first = await engine.complete(question)
    again = await engine.complete(question)
    # All but the last prompt token come from the cache (its logits are needed).
    assert again.usage.cached_input_tokens == again.usage.input_tokens - 1
    assert again.text == first.text
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    one, _ = await engine.score("smollm2", messages, ["Yes", "No"])
    two, u2 = await engine.score("smollm2", messages, ["Yes", "No", "Maybe"])
    # A scoring prompt the cache holds whole costs nothing, not even its last token.
    assert u2.cached_input_tokens == u2.input_tokens
    assert two[:2] == pytest.approx(one, abs=1e-4)


async def test_n_samples_fork_one_read_prompt(engine: LlamaCppEngine) -> None:
    done = await engine.complete(ask("Name a colour.", max_tokens=6, n=3, seed=7))
    assert len(done.choices) == 3 and all(c.text for c in done.choices)
    # One prompt read for three samples: the prompt is counted once.
    alone = await engine.complete(ask("Name a colour.", max_tokens=1))
    assert done.usage.input_tokens == alone.usage.input_tokens
    assert 3 <= done.usage.output_tokens <= 18


async def test_a_cancelled_stream_frees_its_sequence(engine: LlamaCppEngine) -> None:
    steps = engine._states[None].model.steps  # type: ignore[union-attr]
    stream = engine.stream(ask("Tell me a very long story about the sea.", max_tokens=200))
    got = []
    async for piece in stream:
        assert isinstance(piece, Delta | Completion)
        got.append(piece)
        if len(got) == 3:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    # The next request runs only after the scheduler has reaped the cancelled one.
    after = await engine.complete(ask("Hi", max_tokens=2))
    assert after.usage.output_tokens > 0
    assert steps.scheduler.live == []
    held = len(steps.scheduler.cache.free) + len(steps.scheduler.cache.idle)
    assert held == steps.ctx.n_seq  # every sequence id is free or an idle prefix


async def test_a_full_cache_queues_instead_of_failing() -> None:
    # Room for about one request at a time: the others wait for its cells.
    eng = LlamaCppEngine(default_model_path(), n_ctx=128, slots=4, cache_tokens=128)
    try:
        done = await asyncio.gather(
            *[eng.complete(ask(p, max_tokens=60, temperature=0.0)) for p in PROMPTS[:3]]
        )
        assert all(d.usage.output_tokens > 0 for d in done)
    finally:
        await eng.aclose()


async def test_a_decision_sets_later_texts_copy_its_opening() -> None:
    """Each text of a set copies the set's opening; what the next does not share is shelved.

    Every idle cell widens what each step attends over, so a text's own words
    leave the cache when the next text is admitted; asked again, a text comes
    back whole from the shelf, its last row and its answer with it, and scores as
    before, though its candidates were first read beside its prompt's last chunk.
    """
    eng = LlamaCppEngine(default_model_path(), n_ctx=512, slots=4)
    await eng.load()
    try:
        head = (
            "Questions:\nmood: Is the writer happy?\n  - yes\n  - no\n"
            "tone: How formal is it?\n  - formal\n  - casual\n\nText:\n"
        )
        candidates = ["mood: yes", "mood: no"]

        def scored(text: str) -> list[dict[str, str]]:
            return [{"role": "user", "content": head + text}]

        happy, sad = "I love this new phone.", "Terrible service, never again."
        first, _ = await eng.score("smollm2", scored(happy), candidates)
        second, u2 = await eng.score("smollm2", scored(sad), candidates)
        assert 0 < u2.cached_input_tokens < u2.input_tokens
        _, u3 = await eng.score("smollm2", scored("The meeting is at noon."), candidates)
        assert u3.cached_input_tokens == u2.cached_input_tokens  # the opening is still held
        # The first stays whole: asked again, nothing of it is read.
        again_first, a1 = await eng.score("smollm2", scored(happy), candidates)
        assert a1.cached_input_tokens == a1.input_tokens
        # A later text, asked again, comes back whole too, and its scores are the same.
        again_second, a2 = await eng.score("smollm2", scored(sad), candidates)
        assert a2.cached_input_tokens == a2.input_tokens
        # Each came back with the answer kept beside its prompt: the same scores.
        assert again_first == first
        assert again_second == second
    finally:
        await eng.aclose()


def _trie_size(prompts: list[list[int]]) -> int:
    """Cells a set of prompts needs when every shared opening is held once."""
    nodes: set[tuple[int, ...]] = set()
    for tokens in prompts:
        nodes.update(tuple(tokens[: k + 1]) for k in range(len(tokens)))
    return len(nodes)


OPENING = (
    "You label customer messages for a support team. Read the message, decide how the "
    "writer feels and what the message is about, and answer with the labels only. "
    "Be strict: a polite complaint is still a complaint, and a question is not praise."
)


async def test_rows_of_a_run_leave_their_opening_and_shelve_their_texts() -> None:
    """Rows under one system prompt leave its opening idle, not their own texts.

    A unified cache attends over every idle cell, and a row's own text is not
    asked again: after the rows, the cache holds the opening and the newest
    prompt only; the others' own texts went to the shelf in host memory. A
    chat's next turn copies its last turn whole, and a third turn finds the
    second's prompt (on the shelf by then) after other rows ran between them.
    """
    eng = LlamaCppEngine(default_model_path(), n_ctx=512, slots=8)
    await eng.load()
    try:
        steps = eng._states[None].model.steps  # type: ignore[union-attr]
        system = {"role": "system", "content": OPENING}

        def row(text: str, *turns: dict[str, str]) -> CompletionRequest:
            messages = [system, *turns, {"role": "user", "content": text}]
            return CompletionRequest("smollm2", messages, 4, temperature=0.0)

        rows = [f"Message {k}: my order number {k * 7919} has not arrived yet." for k in range(6)]
        done = [await eng.complete(row(text)) for text in rows]
        opening = done[1].usage.cached_input_tokens
        assert opening > 40  # the system prompt, copied
        assert all(d.usage.cached_input_tokens == opening for d in done[1:])
        await steps.call(lambda: None)
        idle = steps.scheduler.cache.idle
        # Beyond the opening, only the newest row's whole prompt is idle.
        assert [len(i.tokens) for i in idle if len(i.tokens) > opening + 1] == [
            done[-1].usage.input_tokens
        ]
        held = await steps.call(lambda: _cells(steps))
        assert held == _trie_size([i.tokens for i in idle])
        # The opening once, and the newest row's own tail: not six rows' worth.
        tail = done[-1].usage.input_tokens - opening
        assert held <= opening + tail + 2
        assert len(steps.scheduler.cache.shelf) == len(rows) - 1

        # A conversation: its second turn copies the first turn's whole prompt.
        first = await eng.complete(row("Hello, who are you?"))
        said = {"role": "assistant", "content": first.text}
        turn = ({"role": "user", "content": "Hello, who are you?"}, said)
        second = await eng.complete(row("And what can you do?", *turn))
        assert second.usage.cached_input_tokens >= first.usage.input_tokens - 1
        # Rows run in between; the second turn's prompt is still whole for the third.
        for text in rows[:3]:
            await eng.complete(row(text + " Please check."))
        turn2 = (*turn, {"role": "user", "content": "And what can you do?"})
        turn2 = (*turn2, {"role": "assistant", "content": second.text})
        third = await eng.complete(row("Thanks!", *turn2))
        assert third.usage.cached_input_tokens >= second.usage.input_tokens - 1
    finally:
        await eng.aclose()


async def test_a_few_tokens_more_than_the_cache_holds_are_taken_from_the_shelf() -> None:
    """Lone chats: a prompt that starts like a shelved one by a few words more takes them back.

    Putting a shelved prompt back costs a copy (~0.1 ms); reading a token costs
    milliseconds. So a chat that shares only "Write a poem about the" with a prompt
    the shelf holds, beyond the chat template's opening the cache still holds,
    reads those words from the shelf instead of evaluating them again.
    """
    eng = LlamaCppEngine(default_model_path(), n_ctx=512, slots=2)
    await eng.load()
    try:
        steps = eng._states[None].model.steps  # type: ignore[union-attr]
        first = await eng.complete(ask("Write a poem about the moon.", 2, temperature=0.0))
        other = await eng.complete(ask("Tell me a fun fact about bees.", 2, temperature=0.0))
        assert len(steps.scheduler.cache.shelf) == 1  # the poem's own words, moved out for the fact
        opening = other.usage.cached_input_tokens  # the template's opening, still in the cache
        assert 0 < opening < first.usage.input_tokens
        again = await eng.complete(ask("Write a poem about the sea.", 2, temperature=0.0))
        # "Write a poem about the" came back from the shelf: 5 tokens or more beyond the opening.
        assert again.usage.cached_input_tokens >= opening + 5
        assert again.usage.cached_input_tokens < again.usage.input_tokens
    finally:
        await eng.aclose()


def _cells(steps: object) -> int:
    """Cells in use in the scheduler's cache, read from llama.cpp's own state (step thread)."""
    import ctypes

    import llama_cpp

    ctx = steps.ctx.ctx.ctx  # type: ignore[attr-defined]
    size = llama_cpp.llama_state_seq_get_size(ctx, -1)
    data = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data(ctx, data, size, -1) == size
    # A magic number and the sequence id (llama_context::state_seq_get_data), then
    # the stream count and the stream's cell count (llama_kv_cache::state_write).
    return int.from_bytes(bytes(data[12:16]), "little")


async def test_the_shelf_keeps_within_its_budget_and_can_be_turned_off() -> None:
    """Prompts moved out of the cache fill the shelf up to its bytes, oldest use out first.

    With no shelf the same requests still run, and a prompt asked again is
    read again.
    """
    topics = ("the moon", "volcanoes", "honey bees", "the Roman empire", "glaciers", "octopuses")
    prompts = [f"Tell me one fact about {t}, in plain words for a young reader." for t in topics]
    for budget in (None, 0):
        eng = LlamaCppEngine(default_model_path(), n_ctx=512, slots=4)
        await eng.load()
        try:
            steps = eng._states[None].model.steps  # type: ignore[union-attr]
            first = await eng.complete(ask(prompts[0], max_tokens=4, temperature=0.0))
            size = await steps.call(lambda: steps.ctx.state_size(steps.scheduler.cache.idle[0].seq))
            # Room for three such prompts (their cells are about 23 KB a token), or none.
            steps.scheduler.cache.shelf_bytes = 3 * size + size // 2 if budget is None else 0
            for prompt in prompts[1:]:
                await eng.complete(ask(prompt, max_tokens=4, temperature=0.0))
            await steps.call(lambda: None)
            assert steps.scheduler.cache.shelf_held <= steps.scheduler.cache.shelf_bytes
            again = await eng.complete(ask(prompts[0], max_tokens=4, temperature=0.0))
            assert again.text == first.text
            if budget is None:
                # The oldest prompts went first; the newest shelved are there to copy.
                assert len(steps.scheduler.cache.shelf) == 3
                late = await eng.complete(ask(prompts[-2], max_tokens=4, temperature=0.0))
                assert late.usage.cached_input_tokens == late.usage.input_tokens - 1
            else:
                assert steps.scheduler.cache.shelf == []
            # The first prompt was long gone from the shelf (or there was none): read again.
            assert again.usage.cached_input_tokens < again.usage.input_tokens - 1
        finally:
            await eng.aclose()


STORY = ask("Tell me a story about a lighthouse keeper and a storm.", 8, temperature=0.0)


@pytest.fixture
async def four_slots() -> AsyncIterator[LlamaCppEngine]:
    """The embedded model with four slots, loaded; closed after the test."""
    eng = LlamaCppEngine(default_model_path(), n_ctx=512, slots=4)
    await eng.load()
    try:
        yield eng
    finally:
        await eng.aclose()


async def test_a_prompt_that_cannot_be_put_back_is_read_instead(
    four_slots: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No run of free cells long enough for a shelved prompt: it is read, not failed."""
    steps = four_slots._states[None].model.steps  # type: ignore[union-attr]
    first = await four_slots.complete(STORY)
    other = await four_slots.complete(ask("Name three rivers in Europe.", 4, temperature=0.0))
    assert other.usage.cached_input_tokens > 0  # the chat template's opening, copied
    assert any(len(s.tokens) == first.usage.input_tokens for s in steps.scheduler.cache.shelf)
    refused: list[int] = []

    def no_room(*_args: object) -> bool:
        refused.append(1)
        return False

    monkeypatch.setattr(steps.ctx, "state_set", no_room)
    again = await four_slots.complete(STORY)
    assert refused == [1]
    assert again.text == first.text
    # Only the chat template's opening, which the cache itself held, was not read.
    assert again.usage.cached_input_tokens == other.usage.cached_input_tokens


async def test_a_decode_refused_for_room_is_sent_again_after_the_idle_prompts_leave(
    four_slots: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's 1 (no cells for the batch): the idle prompts leave, the batch goes again.

    The story, moved to the shelf when the next request was admitted, is found after it.
    """
    steps = four_slots._states[None].model.steps  # type: ignore[union-attr]
    first = await four_slots.complete(STORY)
    assert [len(i.tokens) for i in steps.scheduler.cache.idle] == [first.usage.input_tokens]
    decode = steps.ctx.decode
    refused: list[int] = []

    def fragmented() -> int:
        if not refused:
            refused.append(1)
            return 1  # no slot for the batch: nothing was written
        return int(decode())

    monkeypatch.setattr(steps.ctx, "decode", fragmented)
    other = await four_slots.complete(ask("Name three rivers in Europe.", 4, temperature=0.0))
    monkeypatch.setattr(steps.ctx, "decode", decode)
    assert refused == [1] and other.text
    again = await four_slots.complete(STORY)
    assert again.text == first.text
    assert again.usage.cached_input_tokens == first.usage.input_tokens - 1


async def test_a_stream_says_with_its_first_piece_what_the_cache_gave(
    four_slots: LlamaCppEngine,
) -> None:
    """A stream cut short is settled before its usage comes: the first piece says it."""
    await four_slots.complete(STORY)
    pieces = [p async for p in four_slots.stream(ask("Name three rivers.", 6, temperature=0.0))]
    deltas = [p for p in pieces if isinstance(p, Delta) and p.text]
    [done] = [p for p in pieces if isinstance(p, Completion)]
    assert done.usage.cached_input_tokens > 0  # the chat template's opening
    assert deltas[0].cached_input_tokens == done.usage.cached_input_tokens
    assert all(d.cached_input_tokens is None for d in deltas[1:])
