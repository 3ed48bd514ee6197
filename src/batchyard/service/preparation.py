"""One preparation: any door's parsed request and its caller, turned into a prepared call.

Every door, batch-file line, Message Batch request and deferred item is prepared here and
nowhere else: model and route (and what the route must serve, ``NEEDS``), ``max_tokens``
left out by one rule per kind of request, every token the engine reads counted with the
model's tokenizer, the context window, and the quote. A run's rows are quoted below this
layer (``work.runs.quoting``) by the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from batchyard.core.anthropic_bodies import Translated
from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.openai_bodies import (
    ChatRequest,
    CompletionTextRequest,
    EmbeddingRequest,
    check_images,
)
from batchyard.core.prices import Price
from batchyard.core.quotes import check_context, direct_price, quote
from batchyard.core.tokens import TokenizerSource
from batchyard.engines import tool_calls
from batchyard.errors import CapabilityUnsupported, InvalidRequest, UnknownModel

__all__ = [
    "COMPLETIONS_MAX_TOKENS",
    "DEFERRED_MAX_TOKENS",
    "NEEDS",
    "Prepared",
    "Preparer",
    "engine_messages",
]

#: OpenAI's default ``max_tokens`` for ``/v1/completions`` (and its batch lines).
COMPLETIONS_MAX_TOKENS = 16
#: The deferred-batch spec's default ``max_tokens`` for one of its requests.
DEFERRED_MAX_TOKENS = 1024

#: What a request may need of its route, how the route says it serves it, and the
#: field that asked for it: the one capability table.
NEEDS: dict[str, tuple[Callable[[RouteSpec], bool], str]] = {
    "stream": (lambda r: r.supports_streaming, "stream"),
    "tools": (lambda r: r.tools, "tools"),
    "completions": (lambda r: r.serves_completions, "model"),
    "embeddings": (lambda r: r.embeddings, "model"),
}


@dataclass(frozen=True, slots=True)
class Prepared:
    """A call ready to be paid and sent: what it runs on, what it reads, the most it costs."""

    model: ModelSpec
    route: RouteSpec
    #: The route's name for the model (``Catalog.engine_name``).
    engine_model: str
    #: The most output tokens of one sample (0 for embeddings).
    max_tokens: int
    #: Samples of each prompt.
    n: int
    #: The tokens the engine reads, one count per prompt (one for a chat).
    counts: tuple[int, ...]
    price: Price
    #: The quote: the most the call can cost, in ticks, which is what is held.
    hold: int

    @property
    def input_tokens(self) -> int:
        return sum(self.counts)

    @property
    def output_tokens(self) -> int:
        """The most output tokens the hold pays for: every sample of every prompt."""
        return self.max_tokens * self.n * len(self.counts)


def engine_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The messages an engine without tool calling of its own reads: tool calls and results
    written out as text, and the tools' instructions first where an answer may call one."""
    plain = tool_calls.plain_messages(messages)
    if tools and tool_calls.answer_schema(tools, tool_choice) is not None:
        guide = {"role": "system", "content": tool_calls.tools_prompt(tools, tool_choice)}
        return [guide, *plain]
    return plain


@dataclass(frozen=True, slots=True)
class Preparer:
    """The deployment's catalog, tokenizers and chat default: all a preparation reads."""

    catalog: Catalog
    tokenizers: TokenizerSource
    #: ``max_tokens`` of a chat body that names none (``default_max_tokens``): OpenAI
    #: sets none for chat, so the deployment does, for the door and its batch lines alike.
    chat_max_tokens: int = 256

    def served(self, named: Iterable[tuple[str, Any]], org_id: str | None) -> None:
        """Each model a batch names, by ``(where, name)``, served here: a name nobody serves
        is ``404 unknown_model`` naming its request, before any rule between the batch's
        fields, as at every door. Names that are not strings are the shape's to refuse."""
        for where, name in named:
            if isinstance(name, str) and name and self.catalog.find(name, org_id) is None:
                raise UnknownModel(
                    f"{where}: unknown model {name!r}; GET /v1/models lists the catalog",
                    param=f"{where}.model",
                )

    def resolve(
        self, model_id: object, *needs: str, org_id: str | None
    ) -> tuple[ModelSpec, RouteSpec]:
        """The model and its primary route, refused (a coded 400 naming the field that asked)
        when the route cannot serve what the request needs. ``UnknownModel`` for a name the
        catalog does not hold; a door answers it as its own 404."""
        model = self.catalog.model(model_id, org_id)
        route = self.catalog.route_for(model.id)
        for need in needs:
            serves, param = NEEDS[need]
            if not serves(route):
                raise CapabilityUnsupported(
                    f"{model.id} (route {route.id}) does not support {need}; "
                    "GET /v1/models lists each model's capabilities",
                    param=param,
                )
        return model, route

    def count_chat(
        self,
        model: ModelSpec,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> int:
        """Every token the engine reads of a chat: its template, images and tools' instructions."""
        read = engine_messages(messages, tools, tool_choice)
        return self.tokenizers.for_model(model).count_messages(read)

    def _prepared(
        self,
        model: ModelSpec,
        route: RouteSpec,
        counts: Sequence[int],
        max_tokens: int,
        n: int,
        *,
        param: str,
        where: str = "",
        at: str = "",
    ) -> Prepared:
        """Checked against the model's output limit and window, once per prompt, and quoted.

        ``where`` starts the messages (``"requests[3]: "``), ``at`` the fields' names
        (``"requests[3].body."``) of a request inside a batch."""
        if max_tokens > model.max_output_tokens:
            raise InvalidRequest(
                f"{where}max_tokens can be at most {model.max_output_tokens} for {model.id}",
                param=f"{at}max_tokens",
                code="max_tokens_out_of_range",
            )
        for i, count in enumerate(counts):
            field = at + param if len(counts) == 1 else f"{at}{param}.{i}"
            check_context(model, count, max_tokens, param=field, where=where)
        hold = quote(model, sum(counts), max_tokens, n * len(counts))
        name = self.catalog.engine_name(model.id, route)
        return Prepared(model, route, name, max_tokens, n, tuple(counts), direct_price(model), hold)

    def _max_tokens(self, given: int | None, default: int, model: ModelSpec) -> int:
        return given if given is not None else min(default, model.max_output_tokens)

    def chat(
        self, body: ChatRequest, *, org_id: str | None, stream: bool = False, where: str = ""
    ) -> Prepared:
        """A chat completion: the chat door's, a batch line's, a deferred item's, a run row's."""
        tools = body.tools if body.tools and body.tool_choice != "none" else None
        needs = ["stream"] * stream + ["tools"] * bool(tools)
        model, route = self.resolve(body.model, *needs, org_id=org_id)
        check_images(body.messages, model)
        given = body.max_completion_tokens or body.max_tokens
        max_tokens = self._max_tokens(given, self.chat_max_tokens, model)
        count = self.count_chat(model, body.messages, tools, body.tool_choice)
        return self._prepared(
            model, route, [count], max_tokens, body.n, param="messages", where=where
        )

    def deferred(
        self,
        model_id: str,
        messages: list[dict[str, Any]],
        max_tokens: int | None,
        *,
        org_id: str | None,
        where: str = "",
        at: str = "",
    ) -> Prepared:
        """A deferred batch's request: a chat, with its spec's default ``max_tokens``."""
        model, route = self.resolve(model_id, org_id=org_id)
        mt = self._max_tokens(max_tokens, DEFERRED_MAX_TOKENS, model)
        count = self.count_chat(model, messages)
        return self._prepared(model, route, [count], mt, 1, param="messages", where=where, at=at)

    def messages(self, body: Translated, *, org_id: str | None, stream: bool = False) -> Prepared:
        """Anthropic's Messages (translated): the door's and a Message Batch request's."""
        needs = ["stream"] * stream + ["tools"] * bool(body.tools)
        model, route = self.resolve(body.model, *needs, org_id=org_id)
        check_images(body.messages, model)
        count = self.count_chat(model, body.messages, body.tools, body.tool_choice)
        return self._prepared(model, route, [count], body.max_tokens, 1, param="messages")

    def completion(
        self,
        body: CompletionTextRequest,
        prompts: list[str],
        *,
        org_id: str | None,
        stream: bool = False,
    ) -> Prepared:
        """Text completions: each prompt with the start-of-text token the model reads first."""
        needs = ["completions", *["stream"] * stream]
        model, route = self.resolve(body.model, *needs, org_id=org_id)
        max_tokens = self._max_tokens(body.max_tokens, COMPLETIONS_MAX_TOKENS, model)
        counts = [n + 1 for n in self.tokenizers.for_model(model).count_batch(prompts)]
        return self._prepared(model, route, counts, max_tokens, body.n, param="prompt")

    def embeddings(
        self, body: EmbeddingRequest, texts: list[str], *, org_id: str | None
    ) -> Prepared:
        """Embeddings: each input with its start-of-text token, each within the window."""
        model, route = self.resolve(body.model, "embeddings", org_id=org_id)
        counts = [n + 1 for n in self.tokenizers.for_model(model).count_batch(texts)]
        return self._prepared(model, route, counts, 0, 1, param="input")
