"""Requests as jobs: a completion's prompt and branches, a scoring call's candidates."""

from __future__ import annotations

from functools import partial
from typing import Any

from batchyard.core.tokens import text_messages
from batchyard.engines import tool_calls
from batchyard.engines.llama.context import Adapter
from batchyard.engines.llama.jobs import Branch, Job
from batchyard.engines.llama.models import Model
from batchyard.engines.llama_sampling import (
    CHAT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    TEXT_TEMPERATURE,
    SamplingParams,
    grammar_for,
)
from batchyard.engines.protocol import CompletionRequest
from batchyard.errors import ContextWindowExceeded, UnsupportedInput

__all__ = [
    "after_last_special",
    "candidate_tokens",
    "check_fits",
    "generation_job",
    "prompt_tokens",
    "response_format",
]


#: The most tokens a prompt's tail after its last special token may hold to be kept
#: with the model (``Model.remember``): a turn's opening, never a request's words.
OPENING = 8


def after_last_special(model: Model, text: str, tokens: list[int]) -> tuple[str, list[int]]:
    """The prompt from its last special token on, as text and tokens (the whole when none).

    Tokenizing the returned text gives the returned tokens (checked; for a turn's
    opening once, ``Model.remember``); then text appended to it tokenizes as it
    would appended to the whole prompt.
    """
    import llama_cpp

    llama = model.llama
    vocab = llama._model.vocab
    for i in range(len(tokens) - 1, -1, -1):
        if not llama_cpp.llama_vocab_is_control(vocab, tokens[i]):
            continue
        raw = model.remember(("piece", tokens[i]), partial(llama.detokenize, [tokens[i]], True))
        piece = raw.decode("utf-8", "replace")
        at = text.rfind(piece) if piece else -1
        if at < 0:
            break
        head_text, head = text[at:], tokens[i:]
        check = partial(llama.tokenize, head_text.encode("utf-8"), False, True)
        # A turn's opening is kept; what holds a request's own words is not.
        said = model.remember(("head", head_text), check) if len(head) <= OPENING else check()
        if said == head:
            return head_text, head
        break
    return text, tokens


def response_format(fmt: dict[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """Whether OpenAI's ``response_format`` asks for JSON, and under which schema."""
    if not fmt:
        return False, None
    kind = fmt.get("type")
    if kind == "json_schema":
        return True, (fmt.get("json_schema") or {}).get("schema") or None
    if kind == "json_object":
        return True, fmt.get("schema")
    return False, None


def prompt_tokens(model: Model, request: CompletionRequest, name: str) -> tuple[list[int], bool]:
    """The prompt's tokens and whether the answer is a tool call (under its grammar)."""
    if request.prompt is not None:
        text = request.prompt.encode("utf-8")
        tokens = model.llama.tokenize(text, add_bos=True, special=False)
        # An empty prompt is read as the start-of-text token (as llama-cpp does).
        return tokens or [model.llama.token_bos()], False
    plain, images = text_messages(tool_calls.plain_messages(request.messages))
    if images:
        raise UnsupportedInput(f"{name} reads text only; the request has image parts")
    tools = tool_calls.answer_schema(request.tools or [], request.tool_choice) is not None
    if tools:
        guide = tool_calls.tools_prompt(request.tools or [], request.tool_choice)
        plain = [{"role": "system", "content": guide}, *plain]
    text = model.prompt_text(plain).encode("utf-8")
    return model.llama.tokenize(text, add_bos=False, special=True), tools


def generation_job(
    model: Model,
    request: CompletionRequest,
    *,
    name: str,
    n_ctx: int,
    adapter: Adapter | None,
) -> tuple[Job, bool]:
    """A chat or text completion as a job, and whether its answer is a tool call."""
    if request.prompt is None:
        _, images = text_messages(request.messages)
        if images:
            raise UnsupportedInput(f"{name} reads text only; the request has image parts")
    prompt, tools = prompt_tokens(model, request, name)
    if len(prompt) >= n_ctx:
        raise ContextWindowExceeded(
            f"the prompt is {len(prompt)} tokens; the context window is {n_ctx}"
        )
    grammar = None
    if tools:
        grammar = grammar_for(
            tool_calls.answer_schema(request.tools or [], request.tool_choice), param="tools"
        )
    elif request.prompt is None:
        wants_json, schema = response_format(request.response_format)
        if wants_json:
            grammar = grammar_for(schema)
    default_temperature = CHAT_TEMPERATURE if request.prompt is None else TEXT_TEMPERATURE
    temperature = default_temperature if request.temperature is None else request.temperature
    max_tokens = max(1, min(request.max_tokens, n_ctx - len(prompt)))
    branches = []
    for i in range(max(1, request.n)):
        params = SamplingParams(
            temperature=temperature,
            top_p=DEFAULT_TOP_P if request.top_p is None else request.top_p,
            top_k=DEFAULT_TOP_K if request.top_k is None else request.top_k,
            seed=None if request.seed is None else request.seed + i,
            frequency_penalty=request.frequency_penalty or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            grammar=grammar,
        )
        branches.append(
            Branch(
                params=params,
                max_tokens=max_tokens,
                stops=request.stop,
                logprobs=request.logprobs and not tools,
                top=request.top_logprobs or 0,
            )
        )
    job = Job(prompt, branches, adapter=adapter)
    check_fits(model, job)
    return job, tools


def check_fits(model: Model, job: Job) -> None:
    """The job fits the model's cache and sequence ids at all (else it would wait forever)."""
    ctx = model.steps.ctx
    if job.reserve > ctx.n_cells or len(job.branches) + 1 > ctx.n_seq:
        raise ContextWindowExceeded(
            f"the request needs {job.reserve} cache cells and {len(job.branches) + 1} "
            f"sequences; the embedded model has {ctx.n_cells} and {ctx.n_seq}"
        )


def candidate_tokens(
    model: Model, prompt_text: str, prompt: list[int], candidates: list[str], *, turn_end: bool
) -> list[list[int]]:
    """Each candidate's tokens as they follow the prompt (with the turn's end if asked)."""
    # Each candidate is tokenized after the prompt's last special token, not after
    # the whole prompt: llama.cpp splits a text at its special tokens before it
    # tokenizes the pieces, so what follows one is tokenized the same either way,
    # and a decide call's seven candidates no longer re-read its whole prompt on
    # the event loop (on the cores the model decodes on). A decision set's texts all
    # end with the same turn opening and ask the same candidates, so what depends
    # only on that opening is kept (``Model.remember``): tokenized once per set.
    head_text, head = after_last_special(model, prompt_text, prompt)
    key = ("conts", head_text, tuple(candidates), turn_end)
    kept = model.recall(key) if len(head) <= OPENING and head is not prompt else None
    if kept is not None:
        return [list(c) for c in kept]
    tokenize = model.llama.tokenize
    conts: list[list[int]] = []
    alone = len(head) <= OPENING and head is not prompt
    for candidate in candidates:
        full = tokenize((head_text + candidate).encode("utf-8"), False, True)
        if full[: len(head)] != head:
            full = tokenize((prompt_text + candidate).encode("utf-8"), False, True)
            head, alone = prompt, False
        if full[: len(head)] == head:
            tokens = full[len(head) :]
        else:
            tokens = tokenize(candidate.encode("utf-8"), False, False)
        if turn_end or not tokens:
            tokens = [*tokens, model.turn_end]
        conts.append(tokens)
    if alone:
        model.remember(key, lambda: [list(c) for c in conts])
    return conts
