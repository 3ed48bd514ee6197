"""The ``openai`` SDK's own examples, as a user on its newest release runs them.

Run by ``newest_clients.py`` with the newest SDK's interpreter (``make newest-clients``);
only the base URL, the key and the model name differ from the SDK's examples.
"""

from __future__ import annotations

import enum
import os

import openai
import pydantic

client = openai.OpenAI(base_url=os.environ["BATCHYARD_URL"], api_key=os.environ["BATCHYARD_KEY"])
MODEL = "kettei-core"
print("openai", openai.__version__)

# examples/demo.py: a chat completion, then the same streamed.
completion = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "Say this is a test"}], max_tokens=16
)
assert completion.choices[0].message.content, completion
stream = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "How do I output all files in a directory?"}],
    max_tokens=16,
    stream=True,
)
pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
assert "".join(pieces), pieces

# The legacy text completions.
text = client.completions.create(model=MODEL, prompt="Say this is a test", max_tokens=8)
assert text.choices[0].text and text.usage and text.usage.completion_tokens > 0


# examples/parsing_tools.py: a pydantic tool with an enum and a nested model.
class Column(enum.StrEnum):
    id = "id"
    status = "status"
    expected_delivery_date = "expected_delivery_date"


class Operator(enum.StrEnum):
    eq = "="
    gt = ">"
    lt = "<"


class Condition(pydantic.BaseModel):
    column: str
    operator: Operator
    value: str | int


class Query(pydantic.BaseModel):
    table_name: str
    columns: list[Column]
    conditions: list[Condition]


parsed = client.chat.completions.parse(
    model=MODEL,
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "look up all my orders in november of last year"},
    ],
    tools=[openai.pydantic_function_tool(Query)],
    max_tokens=120,
)
message = parsed.choices[0].message
if message.tool_calls:
    [call] = message.tool_calls
    assert call.function.name == "Query", call
    assert isinstance(call.function.parsed_arguments, Query)
else:  # the model may answer in prose; never with a tool nobody offered
    assert parsed.choices[0].finish_reason in ("stop", "length") and message.content is not None
print("openai examples: ok")
