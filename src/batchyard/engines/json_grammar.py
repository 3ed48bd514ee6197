"""JSON schemas as llama.cpp grammars: every reference resolved, properties in order, JSON strings.

The embedded engine constrains tool calls and ``json_schema`` answers with a
grammar that llama.cpp's converter (llama-cpp-python's
``llama_grammar.SchemaConverter``) writes from the schema. Taken as it is,
the converter falls short of the schemas the dialects accept:

- it resolves ``#/…`` references against the document's root only, so a
  tool's parameters nested in the answer's schema (``{"name", "arguments"}``)
  lose their ``$defs``; and it names a referenced rule after the reference's
  last segment, so two tools that both define ``$defs/Operator`` would share
  the first one's rule;
- its ``char`` rule admits raw control characters, and a pattern's ``.``
  admits ``"`` and ``\\``: a string the grammar allows need not be JSON;
- it reads ``{}`` (any value) as any object.

So a schema is first rewritten (``resolved``): every local reference points
at an entry of one root ``$defs`` with a name of its own, annotation-only
keywords are left out, and ``{}`` says "any JSON value" as a type list. The
grammar's string rules are then tightened to JSON's (``gbnf``). A schema that
cannot be compiled (a remote or dangling reference, a type the converter does
not know) is refused before anything runs, as a 400 ``unsupported_schema``:
never a silent grammar for "any JSON". What the converter cannot express but
does not refuse (``minimum``, ``maxLength`` beside a ``pattern``, ``not``) is
checked on the answer (``tool_calls.parse_answer``).
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

import jsonschema

from batchyard.errors import InvalidRequest

__all__ = ["gbnf", "resolved", "unsupported"]

#: Keywords that only describe: they change nothing a grammar could enforce, and
#: the converter reads a schema with nothing but these as "unrecognized".
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "$comment",
        "examples",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "strict",
    }
)
#: Keywords whose value is data, not a schema: copied as they are.
_DATA = frozenset({"const", "enum", "required"})
#: Keywords whose value maps names to schemas (a property may be called ``$ref``).
_NAMED = frozenset({"properties", "patternProperties", "dependentSchemas"})
_ANY_VALUE: dict[str, Any] = {"type": ["object", "array", "string", "number", "boolean", "null"]}

# llama.cpp's converter writes these two rules; JSON allows no raw control
# character in a string, and a pattern's "any character" must not end the string.
_JSON_CHAR = r'char ::= [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
_JSON_DOT = r'dot ::= [^"\\\x00-\x1F]'


def unsupported(message: str, param: str | None) -> InvalidRequest:
    """The 400 for a schema that cannot become a grammar, naming where and why."""
    return InvalidRequest(message, param=param, code="unsupported_schema")


def resolved(
    schema: dict[str, Any], defs: dict[str, Any], *, prefix: str, param: str
) -> dict[str, Any]:
    """A copy of ``schema`` whose local references point into ``defs`` (the root's ``$defs``).

    Each distinct target (``#/$defs/Operator``, ``#/properties/a``, ``#``
    itself) becomes one entry of ``defs`` named ``prefix`` + its last segment
    (made unique), resolved against ``schema`` itself wherever ``schema`` will
    sit in the document. ``param`` names the schema in a refusal.
    """
    names: dict[str, str] = {}

    def target(ref: str) -> Any:
        node: Any = schema
        for raw in ref[2:].split("/") if ref != "#" else []:
            key = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise unsupported(f"$ref {ref!r} does not resolve within the schema", param)
        if not isinstance(node, dict | bool):
            raise unsupported(f"$ref {ref!r} does not point at a schema", param)
        return node

    def reference(ref: Any) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise unsupported(
                f"$ref {ref!r} is not supported: only references within the schema "
                "(#/$defs/..., #/definitions/...) are",
                param,
            )
        if ref not in names:
            last = ref.rsplit("/", 1)[-1] if ref != "#" else "root"
            name = base = re.sub(r"[^A-Za-z0-9]+", "-", f"{prefix}{unquote(last)}").strip("-")
            k = 1
            while name in defs:
                name, k = f"{base}-{k}", k + 1
            names[ref] = name
            defs[name] = {}  # taken before its target is walked: a schema may refer to itself
            defs[name] = walk(target(ref))
        return f"#/$defs/{names[ref]}"

    def walk(node: Any) -> Any:
        if node is True:
            return dict(_ANY_VALUE)
        if node is False:
            raise unsupported("a schema of false admits no value", param)
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _ANNOTATIONS or key in ("$defs", "definitions"):
                continue
            if key == "$ref":
                out[key] = reference(value)
            elif key in _DATA:
                out[key] = value
            elif key in _NAMED and isinstance(value, dict):
                out[key] = {name: walk(sub) for name, sub in value.items()}
            elif isinstance(value, list):
                out[key] = [walk(v) for v in value]
            elif isinstance(value, dict):
                out[key] = walk(value)
            else:
                out[key] = value
        return out if out else dict(_ANY_VALUE)

    if not isinstance(schema, dict):
        raise unsupported("a JSON schema must be an object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise unsupported(f"not a valid JSON schema: {exc.message}", param) from None
    return dict(walk(schema))


def gbnf(schema: dict[str, Any], *, param: str | None) -> str:
    """The grammar (GBNF text) of a ``resolved`` schema, properties in the schema's order.

    Refused (400 ``unsupported_schema``) where llama.cpp's converter cannot
    write one.
    """
    from llama_cpp import llama_grammar

    if "$ref" in schema:
        # The converter registers references only in nodes that are no reference
        # themselves: a root that is one would leave the ``$defs`` beside it unread.
        rest = {k: v for k, v in schema.items() if k not in ("$ref", "$defs")}
        schema = {"anyOf": [{"$ref": schema["$ref"], **rest}], "$defs": schema.get("$defs", {})}
    try:
        text = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter asserts and raises whatever it meets
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        message = f"the JSON schema cannot be compiled to a grammar: {reason}"
        raise unsupported(message, param) from None
    lines = []
    for line in text.splitlines():
        if line.startswith("char ::= "):
            line = _JSON_CHAR
        elif line.startswith("dot ::= "):
            line = _JSON_DOT
        lines.append(line)
    return "\n".join(lines)
