"""Tool calls for an engine that has no tool calling of its own: a schema, a prompt, a parse.

A small local model asked in prose to "call a tool" answers whatever it likes.
Here it cannot: its output is constrained by a grammar (``json_grammar``
compiles the JSON schema) to a single JSON object that is either a call of one
of the offered tools, ``{"name": <that tool>, "arguments": <its parameters>}``,
or, where ``tool_choice`` lets it decline, a plain reply ``{"content": "..."}``.
Each tool's parameters keep their own ``$defs`` (``json_grammar.resolved``), so
a schema written by pydantic (enums, nested models) is constrained as written;
one the grammar cannot hold is refused up front (400 ``unsupported_schema``).

An answer is read back as a call only when it names an offered tool and its
arguments validate against that tool's schema; anything else (a call cut by
``max_tokens``, a slip the grammar could not rule out) comes back as the text
the model wrote, with its ``finish_reason``, as OpenAI answers it: the model
broke no rule of ours, so it is no error.

Messages that carry earlier calls and their results (an agent's round trip)
are rendered as text the chat template can hold: the call as the JSON it was
produced as, the result as a user-visible tool turn.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import jsonschema

from batchyard.engines.json_grammar import resolved

__all__ = ["answer_schema", "parse_answer", "plain_messages", "tools_prompt"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _offered(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None
) -> tuple[list[dict[str, Any]], bool]:
    """The tools the model may call, and whether it may answer in prose instead."""
    functions = [t["function"] for t in tools if t.get("type") == "function"]
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        return [f for f in functions if f.get("name") == wanted], False
    return functions, tool_choice != "required"


def answer_schema(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None
) -> dict[str, Any] | None:
    """The JSON schema every answer must match; ``None`` when no tool may be called.

    Every tool's parameters sit under ``arguments`` with their references
    rewritten to the root's ``$defs``; a schema that cannot be (a remote or
    dangling ``$ref``, not a JSON schema) is a 400 naming the tool.
    """
    if tool_choice == "none" or not tools:
        return None
    functions, may_decline = _offered(tools, tool_choice)
    defs: dict[str, Any] = {}
    alternatives: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        f = tool.get("function") or {}
        if not any(f is offered for offered in functions):
            continue
        arguments = resolved(
            f.get("parameters") or _ANY_OBJECT,
            defs,
            prefix=f"def-{i}-",
            param=f"tools.{i}.function.parameters",
        )
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
            }
        )
    if may_decline:
        alternatives.append(
            {
                "type": "object",
                "properties": {"content": {"type": "string"}},
                "required": ["content"],
            }
        )
    root = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    return {**root, "$defs": defs} if defs else root


def tools_prompt(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> str:
    """A system message that tells the model what it may call and how to answer."""
    functions, may_decline = _offered(tools, tool_choice)
    listed = "\n".join(
        json.dumps(
            {
                "name": f["name"],
                "description": f.get("description", ""),
                "parameters": f.get("parameters") or _ANY_OBJECT,
            },
            separators=(",", ":"),
        )
        for f in functions
    )
    how = 'Answer with one JSON object: {"name": <tool name>, "arguments": {...}}'
    if may_decline:
        how += ', or {"content": <your reply>} when no tool fits'
    return f"You can call these tools:\n{listed}\n{how}."


def parse_answer(
    text: str,
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] | None,
    *,
    finish_reason: str,
) -> tuple[str, list[dict[str, Any]] | None]:
    """(reply text, tool calls) from a grammar-constrained answer.

    A call counts only when it names an offered tool and its arguments
    validate against that tool's parameters. A plain reply ``{"content": ...}``
    is its content, as far as it was written when cut at ``max_tokens``.
    Anything else (a call cut at ``max_tokens``, arguments the grammar could
    not hold to the schema) is the model's text as it wrote it: the caller
    answers it with its ``finish_reason``, as any reply.
    """
    try:
        data = json.loads(text)
    except ValueError:
        cut = _cut_reply(text) if finish_reason == "length" else None
        return (text if cut is None else cut), None
    if isinstance(data, dict) and "name" in data:
        functions, _ = _offered(tools, tool_choice)
        called = next((f for f in functions if f.get("name") == data["name"]), None)
        arguments = data.get("arguments")
        if called is None or not _valid(arguments, called.get("parameters") or _ANY_OBJECT):
            return text, None
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": str(data["name"]),
                "arguments": json.dumps(arguments, ensure_ascii=False),
            },
        }
        return "", [call]
    if isinstance(data, dict) and isinstance(data.get("content"), str):
        return data["content"], None
    return text, None


def _valid(arguments: Any, schema: dict[str, Any]) -> bool:
    """Whether a call's arguments are an object its tool's JSON schema accepts."""
    if not isinstance(arguments, dict):
        return False
    validator = jsonschema.validators.validator_for(schema)(schema)
    return bool(validator.is_valid(arguments))


_CUT_REPLY = re.compile(r'\s*\{\s*"content"\s*:\s*"')


def _cut_reply(text: str) -> str | None:
    """The text of a ``{"content": "...`` reply cut before its string closed; else None."""
    opening = _CUT_REPLY.match(text)
    if opening is None:
        return None
    body = text[opening.end() :]
    # The string as far as it reads: an escape cut in two (a lone backslash, a "\u"
    # short of its four hex digits) is left out.
    for end in range(len(body), max(-1, len(body) - 6), -1):
        try:
            got = json.loads('"' + body[:end] + '"')
        except ValueError:
            continue
        return got if isinstance(got, str) else None
    return None


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose tool calls and tool results are written out as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if calls:
            written = [
                json.dumps(
                    {
                        "name": c["function"]["name"],
                        "arguments": _loads_or_text(c["function"].get("arguments", "{}")),
                    },
                    ensure_ascii=False,
                )
                for c in calls
            ]
            out.append({"role": "assistant", "content": "\n".join(written)})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"Tool result: {_content_text(m)}"})
        else:
            out.append(m)
    return out


def _content_text(m: dict[str, Any]) -> str:
    content = m.get("content")
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _loads_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
