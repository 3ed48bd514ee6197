"""What the model-calling doors share: the model, the quote, the call, and OpenAI's streams.

``read_body`` authenticates the caller and reads its body strictly;
``resolve`` turns the body's model into the catalog's model and route, with
OpenAI's 404 ``model_not_found`` for a name nobody serves and a coded 400
(``capability_unsupported``) when the route cannot do what is asked.
``quote`` counts what a call may cost at most and checks it fits.

``ModelCall.answer`` is the rest of every door that calls a model (chat,
completions and Anthropic's messages): the tier's limits, the dispatcher's
reserve → call → settle, and the Idempotency-Key rules of
``service.idempotency.run_once``, the answer whole or streamed. A stream is
written by a ``Dialect`` (``api.event_streams``): ``Chunks`` here for OpenAI's
``data:`` chunks, Anthropic's events in ``messages``. A replay of a streamed
request is the saved answer as the stream it was: for OpenAI, one chunk per
choice holding its whole text, then the usage chunk if asked for, then
``[DONE]``. A stream that stops early (the client hung up) saves nothing: the
same key runs again, and the partial answer has been billed exactly for the
tokens produced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from batchyard.api.context import authenticate, check_tier_limits, idempotent, read_json
from batchyard.api.event_streams import DONE, Dialect, events, sse
from batchyard.api.hangups import listening, log_hangup
from batchyard.core.accounts import Principal
from batchyard.core.catalog import ModelSpec, RouteSpec
from batchyard.core.prices import Price
from batchyard.core.quotes import check_context, direct_price
from batchyard.core.quotes import quote as quote_most
from batchyard.core.tokens import Tokenizer
from batchyard.engines.protocol import CompletionRequest, Delta
from batchyard.errors import (
    BatchyardError,
    CapabilityUnsupported,
    InvalidRequest,
    ModelNotFound,
    UnknownModel,
)
from batchyard.service import Service, model_versions
from batchyard.service.deployment import service_of
from batchyard.service.idempotency import Stream
from batchyard.work.dispatcher import DispatchResult
from batchyard.work.openai_wire import Reply

__all__ = [
    "Capability",
    "Chunks",
    "ModelCall",
    "Quote",
    "chat_needs",
    "quote",
    "read_body",
    "resolve",
]

Capability = str  # "chat", "completions", "embeddings", "tools", "stream"

_Body = TypeVar("_Body")


async def read_body(
    request: Request, parse: Callable[[dict[str, Any]], _Body], *, x_api_key: bool = False
) -> tuple[Principal, dict[str, Any], Service, _Body]:
    """The prelude of every model door: the caller, its JSON body, the service, the body checked.

    ``x_api_key``: also take the key from Anthropic's ``x-api-key`` header.
    """
    principal = await authenticate(request, x_api_key=x_api_key)
    raw = await read_json(request)
    svc = service_of(request)
    # A project version named here is read from the store off the event loop.
    await model_versions.resolve(svc, raw.get("model"))
    return principal, raw, svc, parse(raw)


def resolve(
    svc: Service, model_id: str, *needs: Capability, org_id: str | None = None
) -> tuple[ModelSpec, RouteSpec]:
    """The model and its primary route, checked against what the request needs.

    A model version uploaded into a project (``mv.…``) is only its
    organisation's: to anyone else it does not exist.
    """
    try:
        model = svc.catalog.model(model_id, org_id)
    except UnknownModel:
        raise ModelNotFound(
            f"the model {model_id!r} does not exist; GET /v1/models lists the catalog",
            param="model",
        ) from None
    route = svc.catalog.route_for(model.id)
    for need in needs:
        ok = {
            "tools": route.tools,
            "stream": route.supports_streaming,
            "completions": route.serves_completions,
            "embeddings": route.embeddings,
        }.get(need, True)
        if not ok:
            raise CapabilityUnsupported(
                f"{model.id} (route {route.id}) does not support {need}; "
                "GET /v1/models lists each model's capabilities",
                param={"stream": "stream", "tools": "tools"}.get(need, "model"),
            )
    return model, route


def chat_needs(stream: bool, tools: bool) -> list[Capability]:
    """What a chat-shaped call (OpenAI's or Anthropic's) needs of its route."""
    return ["chat", *(["stream"] if stream else []), *(["tools"] if tools else [])]


@dataclass(frozen=True, slots=True)
class Quote:
    """What a call may cost at most: its prompts counted, its price, the hold."""

    tokenizer: Tokenizer
    #: Each prompt's tokens (one for chat; one per prompt of a list of completions).
    counts: list[int]
    price: Price
    max_cost: int

    @property
    def input_tokens(self) -> int:
        return sum(self.counts)


def quote(
    tokenizer: Tokenizer,
    model: ModelSpec,
    counts: Sequence[int],
    max_tokens: int,
    n: int = 1,
    *,
    param: str,
) -> Quote:
    """The most a call can cost: every prompt, and ``max_tokens`` for each of ``n`` samples.

    ``max_tokens`` over the model's output limit, or a prompt that leaves no
    room for it in the context window, is a coded 400 before anything is
    held; ``param`` names the prompt (``prompt.i`` for one of a list).
    """
    if max_tokens > model.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens can be at most {model.max_output_tokens} for {model.id}",
            param="max_tokens",
            code="max_tokens_out_of_range",
        )
    for i, count in enumerate(counts):
        check_context(model, count, max_tokens, param=param if len(counts) == 1 else f"{param}.{i}")
    most = quote_most(model, sum(counts), max_tokens, n * len(counts))
    return Quote(tokenizer, list(counts), direct_price(model), most)


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One paid model call at a door: who asked, which model and route, the quote, its ID."""

    request: Request
    principal: Principal
    model: ModelSpec
    route: RouteSpec
    quote: Quote
    purpose: str
    ref: str

    async def answer(
        self,
        raw: dict[str, Any],
        requests: Sequence[CompletionRequest],
        render: Callable[[DispatchResult], dict[str, Any]],
        stream: Dialect | None = None,
    ) -> Response:
        """Limits, reserve → call → settle, under the key: ``render``'s body, or ``stream``'s.

        ``requests`` pair with the quote's counts; several (a list of prompts)
        are one call to the caller: one hold, one charge, one answer.
        """
        svc = service_of(self.request)
        pay: dict[str, Any] = {
            "org_id": self.principal.org_id,
            "model": self.model,
            "route": self.route,
            "max_cost": self.quote.max_cost,
            "price": self.quote.price,
            "purpose": self.purpose,
            "ref": self.ref,
        }

        async def limits() -> None:
            await check_tier_limits(
                self.request, self.principal, requests=1, tokens=self.quote.input_tokens
            )

        if stream is not None:
            dialect = stream

            async def streamed() -> tuple[int, Any]:
                await limits()
                pieces = svc.dispatcher.stream(
                    request=requests[0],
                    input_tokens=self.quote.input_tokens,
                    count_tokens=self.quote.tokenizer.count,
                    **pay,
                )
                first = await anext(pieces)
                return 200, Stream(events(dialect, first, pieces))

            return await idempotent(
                self.request, self.principal, raw, streamed, stream_replay=dialect.replay
            )

        async def whole() -> tuple[int, Any]:
            await limits()
            async with listening(self.request) as hangup:
                stoppable = [replace(r, hangup=hangup) for r in requests]
                try:
                    if len(stoppable) > 1:
                        each = list(zip(stoppable, self.quote.counts, strict=True))
                        result = await svc.dispatcher.execute_all(requests=each, **pay)
                    else:
                        result = await svc.dispatcher.execute(
                            request=stoppable[0], input_tokens=self.quote.input_tokens, **pay
                        )
                except BatchyardError:
                    if hangup.is_set():
                        log_hangup(self.ref, self.route.id, None)
                    raise
            if hangup.is_set():
                log_hangup(self.ref, self.route.id, result.completion.usage.output_tokens)
            return 200, render(result)

        return await idempotent(self.request, self.principal, raw, whole)


@dataclass
class Chunks:
    """OpenAI's stream ``Dialect``: chat's ``delta`` chunks or completions' ``text`` ones."""

    reply: Reply
    object: str
    n: int
    include_usage: bool
    #: Choice ``i``'s first chunk choice.
    first: Callable[[int], dict[str, Any]]
    #: A piece as a chunk choice.
    choice: Callable[[Delta], dict[str, Any]]
    #: The whole answer (as saved under a key) from the stream's result.
    render: Callable[[DispatchResult], dict[str, Any]]
    #: A saved answer's choices as chunk choices, one each.
    replayed: Callable[[dict[str, Any]], list[dict[str, Any]]]

    def _chunk(
        self, choices: list[dict[str, Any]], usage: Any = None, reply: Reply | None = None
    ) -> bytes:
        of = reply or self.reply
        return sse(of.chunk(self.object, choices, include_usage=self.include_usage, usage=usage))

    def opening(self) -> list[bytes]:
        return [self._chunk([self.first(i) for i in range(self.n)])]

    def piece(self, piece: Delta) -> list[bytes]:
        if not (piece.text or piece.tool_calls or piece.finish_reason):
            return []
        return [self._chunk([self.choice(piece)])]

    def whole(self, result: DispatchResult) -> dict[str, Any]:
        return self.render(result)

    def closing(self, whole: dict[str, Any]) -> list[bytes]:
        usage = [self._chunk([], whole["usage"])] if self.include_usage else []
        return [*usage, DONE]

    def error(self, exc: BatchyardError) -> bytes:
        # The status line has gone; OpenAI's clients read an error event.
        return sse(exc.to_body())

    def replay(self, whole: dict[str, Any]) -> bytes:
        """A saved answer as the stream it was: a chunk per choice, the usage, ``[DONE]``."""
        saved = Reply(whole["id"], whole["created"], whole["model"])
        parts = [self._chunk([c], reply=saved) for c in self.replayed(whole)]
        if self.include_usage:
            parts.append(self._chunk([], whole.get("usage"), reply=saved))
        return b"".join([*parts, DONE])
