"""The one preparation, called directly: what a call reads, how long it may answer, its hold.

The default catalog (kettei-core on the embedded route) and the embedded model's own
tokenizer (its vocabulary and chat template, read from the GGUF file without loading the
weights), so every count is the one the engine's prompt comes to.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from batchyard.core.anthropic_bodies import parse_messages, translate
from batchyard.core.catalog import Catalog, RouteSpec, default_catalog
from batchyard.core.openai_bodies import parse_chat, parse_completion, parse_embedding
from batchyard.core.quotes import quote
from batchyard.engines import tool_calls
from batchyard.engines.tokenizers import Tokenizers
from batchyard.errors import CapabilityUnsupported, ContextWindowExceeded, InvalidRequest
from batchyard.service.openai_requests import CHAT, COMPLETIONS, MESSAGES, Rules, validate_line
from batchyard.service.preparation import (
    COMPLETIONS_MAX_TOKENS,
    DEFERRED_MAX_TOKENS,
    Preparer,
)

ASK = [{"role": "user", "content": "Which city is warmest: Lisbon, Oslo or Cairo?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": f"tool_{i}", "description": d, "parameters": CITY}}
    for i, d in enumerate(["weather", "time", "currency", "translate", "flights", "tables"])
]


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    return Tokenizers()


@pytest.fixture
def preparer(tokenizers: Tokenizers) -> Preparer:
    return Preparer(default_catalog(), tokenizers, chat_max_tokens=256)


def chat(**body: Any) -> Any:
    return parse_chat({"model": "kettei-core", "messages": ASK, **body})


def test_a_chat_with_tools_counts_the_tools_instructions_the_engine_reads(
    preparer: Preparer, tokenizers: Tokenizers
) -> None:
    p = preparer.chat(chat(tools=TOOLS, max_tokens=8), org_id=None)
    tok = tokenizers.for_model(p.model)
    guide = {"role": "system", "content": tool_calls.tools_prompt(TOOLS, None)}
    assert p.counts == (tok.count_messages([guide, *ASK]),)
    # The chat: six tools are most of what the engine reads.
    assert p.input_tokens > 5 * tok.count_messages(ASK)
    assert p.hold == quote(p.model, p.input_tokens, 8)
    # tool_choice "none" sends no tools, so none are read or counted.
    plain = preparer.chat(chat(tools=TOOLS, tool_choice="none", max_tokens=8), org_id=None)
    assert plain.counts == (tok.count_messages(ASK),)


def test_n_samples_and_a_system_prompt_are_held_for(
    preparer: Preparer, tokenizers: Tokenizers
) -> None:
    system = [{"role": "system", "content": "Answer in one short sentence. " * 40}, *ASK]
    p = preparer.chat(chat(messages=system, n=3, max_tokens=8), org_id=None)
    assert p.counts == (tokenizers.for_model(p.model).count_messages(system),)
    assert p.output_tokens == 24 and p.hold == quote(p.model, p.input_tokens, 8, 3)


def test_max_tokens_left_out_follows_one_rule_per_kind_of_request(preparer: Preparer) -> None:
    assert preparer.chat(chat(), org_id=None).max_tokens == 256
    body = parse_completion({"model": "kettei-core", "prompt": "Say hi", "max_tokens": None})
    assert preparer.completion(body, ["Say hi"], org_id=None).max_tokens == COMPLETIONS_MAX_TOKENS
    deferred = preparer.deferred("kettei-core", ASK, None, org_id=None)
    assert deferred.max_tokens == DEFERRED_MAX_TOKENS
    # And the same body gets the same default as a line of a batch file.
    rules = Rules(preparer)
    line = validate_line(CHAT, {"model": "kettei-core", "messages": ASK}, rules)
    assert line.max_output_tokens == 256
    line = validate_line(COMPLETIONS, {"model": "kettei-core", "prompt": "Say hi"}, rules)
    assert line.max_output_tokens == COMPLETIONS_MAX_TOKENS


def test_a_batch_line_is_prepared_exactly_as_the_door_prepares_its_body(
    preparer: Preparer,
) -> None:
    body = {"model": "kettei-core", "messages": ASK, "tools": TOOLS, "n": 2, "max_tokens": 8}
    door = preparer.chat(parse_chat(body), org_id=None)
    line = validate_line(CHAT, body, Rules(preparer))
    assert (line.input_tokens, line.max_output_tokens) == (door.input_tokens, door.output_tokens)
    anthropic = {
        "model": "kettei-core",
        "max_tokens": 8,
        "messages": ASK,
        "tools": [{"name": "get_weather", "input_schema": CITY}],
    }
    asked = preparer.messages(translate(parse_messages(anthropic)), org_id=None)
    batched = validate_line(MESSAGES, anthropic, Rules(preparer))
    assert batched.input_tokens == asked.input_tokens > preparer.count_chat(asked.model, ASK)


@pytest.mark.parametrize(
    ("given", "code"),
    [({"mode": "maybe"}, "invalid_privacy_mode"), ("redact", "invalid_type"), ({"x": 1}, None)],
)
def test_a_batch_lines_privacy_is_the_deferred_requests_shape(
    preparer: Preparer, given: Any, code: str | None
) -> None:
    body = {"model": "kettei-core", "messages": ASK, "privacy": given}
    with pytest.raises(InvalidRequest) as refused:
        validate_line(CHAT, body, Rules(preparer))
    assert refused.value.code == (code or "unknown_field")
    assert refused.value.param is not None and refused.value.param.startswith("privacy")
    kept = validate_line(CHAT, {**body, "privacy": {}}, Rules(preparer))  # {} is off
    assert (kept.redactions, "privacy" in kept.body) == (0, False)


def test_the_window_and_the_output_limit_are_checked_once_here(preparer: Preparer) -> None:
    with pytest.raises(InvalidRequest) as too_long:
        preparer.chat(chat(max_tokens=5000), org_id=None)
    assert too_long.value.code == "max_tokens_out_of_range"
    huge = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(ContextWindowExceeded) as full:
        preparer.chat(chat(messages=huge, max_tokens=8), org_id=None)
    assert full.value.param == "messages"
    texts = ["Say hi", "word " * 3000]
    body = parse_completion({"model": "kettei-core", "prompt": texts})
    with pytest.raises(ContextWindowExceeded) as second:
        preparer.completion(body, texts, org_id=None)
    assert second.value.param == "prompt.1"
    emb = parse_embedding({"model": "kettei-core", "input": texts})
    with pytest.raises(ContextWindowExceeded):
        preparer.embeddings(emb, texts, org_id=None)


def test_a_prompt_over_the_embedded_engines_window_is_refused_here_not_by_the_engine(
    tokenizers: Tokenizers,
) -> None:
    """With ``embedded_n_ctx`` below the catalog's window, the preparation holds the engine's."""
    narrow = Preparer(default_catalog().embedded_within(512), tokenizers, chat_max_tokens=256)
    long = [{"role": "user", "content": "word " * 600}]
    assert preparer_fits(Preparer(default_catalog(), tokenizers), long)
    with pytest.raises(ContextWindowExceeded) as over:
        narrow.chat(chat(messages=long, max_tokens=8), org_id=None)
    assert "512-token context window" in over.value.message


def preparer_fits(preparer: Preparer, messages: list[dict[str, Any]]) -> bool:
    return preparer.chat(chat(messages=messages, max_tokens=8), org_id=None).input_tokens > 512


def test_what_the_route_cannot_serve_is_refused_naming_the_field_that_asked(
    tokenizers: Tokenizers,
) -> None:
    base = default_catalog()
    [embedded] = base.routes.values()
    serves_nothing = {"supports_tools": False, "supports_streaming": False}
    serves_nothing |= {"serves_completions": False, "serves_embeddings": False}
    bare: RouteSpec = dataclasses.replace(embedded, **serves_nothing)
    preparer = Preparer(Catalog(list(base.models.values()), [bare]), tokenizers)
    with pytest.raises(CapabilityUnsupported) as tools:
        preparer.chat(chat(tools=TOOLS), org_id=None)
    assert tools.value.param == "tools"
    with pytest.raises(CapabilityUnsupported) as stream:
        preparer.chat(chat(), org_id=None, stream=True)
    assert stream.value.param == "stream"
    emb = parse_embedding({"model": "kettei-core", "input": "hi"})
    with pytest.raises(CapabilityUnsupported) as embeddings:
        preparer.embeddings(emb, ["hi"], org_id=None)
    assert embeddings.value.param == "model"
