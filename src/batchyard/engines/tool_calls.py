"""Tool calls for an engine that has no tool calling of its own: a schema, a prompt, a parse.

A small local model asked in prose to "call a tool" answers whatever it likes.
Here it cannot: its output is constrained by a grammar (llama.cpp compiles a
JSON schema into one) to a single JSON object that is either a call of one of
the offered tools, ``{"name": <that tool>, "arguments": <its parameters>}``, or,
where ``tool_choice`` lets it decline, a plain reply ``{"content": "..."}``. So
every answer parses, and every call's arguments match its tool's schema.

Messages that carry earlier calls and their results (an agent's round trip)
are rendered as text the chat template can hold: the call as the JSON it was
produced as, the result as a user-visible tool turn.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from batchyard.errors import ModelOutputInvalid

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
    """The JSON schema every answer must match; ``None`` when no tool may be called."""
    if tool_choice == "none" or not tools:
        return None
    functions, may_decline = _offered(tools, tool_choice)
    alternatives: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or _ANY_OBJECT,
            },
            "required": ["name", "arguments"],
        }
        for f in functions
    ]
    if may_decline:
        alternatives.append(
            {
                "type": "object",
                "properties": {"content": {"type": "string"}},
                "required": ["content"],
            }
        )
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


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


def parse_answer(text: str, *, finish_reason: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(reply text, tool calls) from a grammar-constrained answer.

    The grammar makes the answer valid JSON unless generation stopped at
    ``max_tokens`` mid-object. A plain reply cut there is a reply cut at
    ``max_tokens``, as any chat answer is: its text so far comes back (the
    caller reports ``finish_reason`` ``length``). A tool call cut there has no
    complete arguments: that is ``model_output_invalid`` (nothing is charged
    for it), with the advice to allow more tokens.
    """
    try:
        data = json.loads(text)
    except ValueError:
        cut = _cut_reply(text) if finish_reason == "length" else None
        if cut is not None:
            return cut, None
        raise ModelOutputInvalid(
            "the model's tool call was cut off before it was complete "
            f"(finish_reason {finish_reason}); allow more max_tokens",
            param="max_tokens",
        ) from None
    if isinstance(data, dict) and "name" in data:
        call = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": str(data["name"]),
                "arguments": json.dumps(data.get("arguments", {}), ensure_ascii=False),
            },
        }
        return "", [call]
    if isinstance(data, dict) and isinstance(data.get("content"), str):
        return data["content"], None
    raise ModelOutputInvalid("the model's answer is neither a tool call nor a reply")


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
