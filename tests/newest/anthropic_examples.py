"""The ``anthropic`` SDK's own examples, as a user on its newest release runs them.

Run by ``newest_clients.py`` with the newest SDK's interpreter (``make newest-clients``);
only the base URL, the key and the model name differ from the SDK's examples.
"""

from __future__ import annotations

import os
import time

import anthropic
from pydantic import BaseModel

client = anthropic.Anthropic(
    base_url=os.environ["BATCHYARD_BASE"], api_key=os.environ["BATCHYARD_KEY"]
)
MODEL = "kettei-core"
print("anthropic", anthropic.__version__)
ASK = [{"role": "user", "content": "Hello, Claude"}]

# examples/messages.py
message = client.messages.create(model=MODEL, max_tokens=24, messages=ASK)
assert message.content and message.content[0].type == "text", message

# examples/messages_stream.py
with client.messages.stream(model=MODEL, max_tokens=24, messages=ASK) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed and final.usage.output_tokens > 0

# count_tokens
counted = client.messages.count_tokens(model=MODEL, messages=ASK)
assert counted.input_tokens == message.usage.input_tokens, (counted, message.usage)

# examples/batch_results.py: a Message Batch, polled, then its results.
batch = client.messages.batches.create(
    requests=[
        {"custom_id": f"req-{i}", "params": {"model": MODEL, "max_tokens": 8, "messages": ASK}}
        for i in range(2)
    ]
)
deadline = time.monotonic() + 600
while batch.processing_status != "ended":
    assert time.monotonic() < deadline, batch
    time.sleep(1)
    batch = client.messages.batches.retrieve(batch.id)
results = {r.custom_id: r.result.type for r in client.messages.batches.results(batch.id)}
assert results == {"req-0": "succeeded", "req-1": "succeeded"}, results


# examples/structured_outputs.py: messages.parse sends output_config; the answer is held to
# the schema by the same grammar as OpenAI's response_format.
class Verdict(BaseModel):
    wet: bool
    sure: bool


parsed = client.messages.parse(
    model=MODEL,
    max_tokens=32,
    messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}],
    output_format=Verdict,
)
assert isinstance(parsed.parsed_output, Verdict), parsed
print("anthropic examples: ok")
