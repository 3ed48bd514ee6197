"""OpenAI's model doors (chat, completions, embeddings) and what every model door shares.

``read_body`` and ``prepared`` are every model door's prelude: the caller, the
body read strictly, the door's preparation (``service.preparation``) with
OpenAI's 404 ``model_not_found`` for a name nobody serves. ``ModelCall.answer``
is the rest: the tier's limits, the dispatcher's reserve → call → settle, the
Idempotency-Key rules of ``service.idempotency.run_once``, the answer whole or
streamed (``work.openai_wire``'s, which batch lines share, with the settled
``charge`` beside).

A stream is one loop (``events``) whichever dialect writes it; a ``Dialect``
says only what each step looks like on the wire (``Chunks`` for OpenAI's, the
Messages door's ``_Events`` for Anthropic's). It ends with the whole answer,
kept under the key and replayed as the stream it was; a stream cut short (the
client hung up) stops the engine, is billed for the tokens produced, and saves
nothing, so the same key runs again.

A whole answer writes nothing until the end, so a client that hangs up on one
is heard by ``listening`` (``http.disconnect``) and the engine stops at its next
step (``CompletionRequest.hangup``) instead of generating to ``max_tokens`` for
nobody and being paid in full (an SDK's timeout, then its retry, paid twice).

A list of prompts to ``/v1/completions`` is one call to its caller: one tier
check, one hold, one charge. Token-id prompts and inputs are read as
``cl100k_base`` ids (``engines.token_ids``), as LangChain's
``OpenAIEmbeddings()`` sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from batchyard.api.context import authenticate, check_tier_limits, once, read_json
from batchyard.api.openapi import MODEL_CALL, ChatCompletion, EmbeddingList, TextCompletion, declare
from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import (
    ChatRequest,
    CompletionTextRequest,
    EmbeddingRequest,
    parse_chat,
    parse_completion,
    parse_embedding,
)
from batchyard.engines.protocol import CompletionRequest, Delta
from batchyard.engines.token_ids import as_texts
from batchyard.errors import (
    BatchyardError,
    CapabilityUnsupported,
    InternalError,
    ModelNotFound,
    UnknownModel,
)
from batchyard.service import Service, model_versions
from batchyard.service.deployment import service_of
from batchyard.service.idempotency import Stream, Whole
from batchyard.service.preparation import Prepared
from batchyard.work.dispatcher import DispatchResult
from batchyard.work.openai_wire import (
    Reply,
    chat_first,
    chat_piece,
    chat_replay,
    chat_request,
    embedding_list,
    text_piece,
    text_replay,
    text_requests,
)

__all__ = ["Chunks", "Dialect", "ModelCall", "prepared", "read_body", "router", "sse"]

router = APIRouter()
Piece = Delta | DispatchResult

#: OpenAI's last event.
DONE = b"data: [DONE]\n\n"


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event of JSON ``data``, named where the dialect names its events."""
    head = f"event: {event}\n".encode() if event is not None else b""
    return head + b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class Dialect(Protocol):
    """How one answer's stream is written in one dialect (state may live here: blocks open)."""

    def opening(self) -> list[bytes]:
        """The events before the first piece."""
        ...

    def piece(self, piece: Delta) -> list[bytes]:
        """The events of one piece of the answer (none for an empty piece)."""
        ...

    def closing(self, whole: dict[str, Any]) -> list[bytes]:
        """The events after the last piece."""
        ...

    def error(self, exc: BatchyardError) -> bytes:
        """A failure after the status line has gone, as the dialect's clients read it."""
        ...

    def replay(self, whole: dict[str, Any]) -> bytes:
        """A kept answer as the stream it was (the same request again under its key)."""
        ...


async def events(
    dialect: Dialect,
    render: Callable[[DispatchResult], dict[str, Any]],
    first: Piece,
    pieces: AsyncIterator[Piece],
) -> AsyncGenerator[bytes | Whole, None]:
    """The stream's events in ``dialect``, then its whole answer as ``render`` makes it.

    ``first`` is the piece the door awaited before answering (so a refusal
    was an ordinary error answer); ``pieces`` are the rest.
    """
    finished = False
    try:
        for event in dialect.opening():
            yield event
        piece = first
        while not isinstance(piece, DispatchResult):
            for event in dialect.piece(piece):
                yield event
            piece = await anext(pieces)
        whole = render(piece)
        for event in dialect.closing(whole):
            yield event
        finished = True
        yield Whole(whole)
    except BatchyardError as exc:
        yield dialect.error(exc)
    except StopAsyncIteration:
        yield dialect.error(InternalError("the stream ended without a result"))
    finally:
        if not finished:
            await pieces.aclose()  # type: ignore[attr-defined]


log = logging.getLogger("batchyard.api")


@contextlib.asynccontextmanager
async def listening(request: Request) -> AsyncIterator[asyncio.Event]:
    """An event set when the client of ``request`` hangs up, while the block runs.

    The body has been read whole before, so what the server hands the app
    from now on is only ``http.disconnect``.
    """
    hangup = asyncio.Event()

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        hangup.set()

    task = asyncio.create_task(listen())
    try:
        yield hangup
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def log_hangup(ref: str, route: str, output_tokens: int | None) -> None:
    """One structured line for a whole answer whose client hung up (no content, no caller)."""
    log.info(
        "client hung up; generation stopped",
        extra={
            "event": "client_disconnected",
            "ref": ref,
            "route": route,
            "output_tokens": output_tokens,
        },
    )


_Body = TypeVar("_Body")
_Done = TypeVar("_Done")


async def read_body(
    request: Request, parse: Callable[[dict[str, Any]], _Body]
) -> tuple[Principal, dict[str, Any], Service, _Body]:
    """The prelude of every model door: the caller, its JSON body, the service, the body checked."""
    principal = await authenticate(request)
    raw = await read_json(request)
    svc = service_of(request)
    # A project version named here is read from the store off the event loop.
    await model_versions.resolve(svc, raw.get("model"))
    if isinstance(name := raw.get("model"), str) and name:
        # A model nobody serves is 404 whatever else the body holds: the rules between a
        # body's fields (a tool_choice naming a tool) are the model's call's, not a shape's.
        prepared(name, lambda: svc.catalog.model(name, principal.org_id))
    return principal, raw, svc, parse(raw)


def prepared(model_id: str, prepare: Callable[[], _Done]) -> _Done:
    """A door's preparation (``service.preparation``), with OpenAI's 404 ``model_not_found``
    for ``model_id`` where nobody serves it."""
    try:
        return prepare()
    except UnknownModel:
        raise ModelNotFound(
            f"the model {model_id!r} does not exist; GET /v1/models lists the catalog",
            param="model",
        ) from None


def declared(schema: type[BaseModel], answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` built through ``schema``, the declaration the OpenAPI document shows.

    A completion's body cannot leave without the fields its declaration
    requires, of the types it gives, whatever test saw it or not (the suite's
    wire check sees only the answers the tests ask for). The fields given are
    the fields sent (``exclude_unset``): a declared field the answer leaves out
    (``tool_calls`` of a message without any) stays out rather than going out
    null. Measured, this costs nothing the gateway's throughput shows
    (docs/explanation/benchmarks.md).
    """
    return schema.model_validate(answer).model_dump(mode="json", exclude_unset=True)


@dataclass(frozen=True, slots=True)
class ModelCall:
    """One paid model call at a door: who asked, the prepared call, its purpose and ID."""

    request: Request
    principal: Principal
    call: Prepared
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

        ``requests`` pair with the prepared call's counts; several (a list of
        prompts) are one call to the caller: one hold, one charge, one answer.
        """
        svc = service_of(self.request)
        call = self.call
        pay: dict[str, Any] = {
            "org_id": self.principal.org_id,
            "key_id": self.principal.key_id,
            "model": call.model,
            "route": call.route,
            "max_cost": call.hold,
            "price": call.price,
            "purpose": self.purpose,
            "ref": self.ref,
        }

        async def limits() -> None:
            await check_tier_limits(self.request, self.principal, tokens=call.input_tokens)

        if stream is not None:
            dialect = stream

            async def streamed() -> Stream:
                await limits()
                pieces = svc.dispatcher.stream(
                    request=requests[0],
                    input_tokens=call.input_tokens,
                    count_tokens=svc.tokenizer(call.model).count,
                    **pay,
                )
                first = await anext(pieces)
                return Stream(events(dialect, render, first, pieces))

            return await once(
                self.request, self.principal, raw, streamed, stream_replay=dialect.replay
            )

        async def whole() -> dict[str, Any]:
            await limits()
            async with listening(self.request) as hangup:
                stoppable = [replace(r, hangup=hangup) for r in requests]
                each = list(zip(stoppable, call.counts, strict=True))
                try:
                    result = await svc.dispatcher.execute(requests=each, **pay)
                except BatchyardError:
                    if hangup.is_set():
                        log_hangup(self.ref, call.route.id, None)
                    raise
            if hangup.is_set():
                log_hangup(self.ref, call.route.id, result.completion.usage.output_tokens)
            return render(result)

        return await once(self.request, self.principal, raw, whole)


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


@router.post("/v1/chat/completions", summary="Chat completions (OpenAI's shape)")
@declare(ChatCompletion, body=ChatRequest, errors=MODEL_CALL, streams=True)
async def chat_completions(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_chat)
    org_id, stream = principal.org_id, bool(body.stream)
    p = prepared(body.model, lambda: svc.preparer.chat(body, org_id=org_id, stream=stream))
    req = chat_request(body, model=p.engine_model, max_tokens=p.max_tokens)
    now = svc.clock.now()
    call = ModelCall(request, principal, p, "chat", new_id("chatcmpl", now))
    reply = Reply(call.ref, int(now.timestamp()), p.model.id)
    logprobs = bool(body.logprobs)

    def render(result: DispatchResult) -> dict[str, Any]:
        answer = {
            **reply.chat(result.completion, logprobs=logprobs),
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
            "created_at": isoformat(now),
        }
        return declared(ChatCompletion, answer)

    chunks = None
    if body.stream:
        chunks = Chunks(
            reply=reply,
            object="chat.completion.chunk",
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            first=chat_first,
            choice=lambda d: chat_piece(d, logprobs),
            replayed=chat_replay,
        )
    return await call.answer(raw, [req], render, chunks)


@router.post("/v1/completions", summary="Text completions (OpenAI's shape)")
@declare(TextCompletion, body=CompletionTextRequest, errors=MODEL_CALL, streams=True)
async def completions(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_completion)
    prompts = as_texts(body.prompts(), "prompt")
    if body.stream and len(prompts) > 1:
        raise CapabilityUnsupported(
            "a stream answers one prompt; send the list without stream", param="stream"
        )
    org_id, stream = principal.org_id, bool(body.stream)
    p = prepared(
        body.model, lambda: svc.preparer.completion(body, prompts, org_id=org_id, stream=stream)
    )
    reqs = text_requests(body, prompts, model=p.engine_model, max_tokens=p.max_tokens)
    now = svc.clock.now()
    call = ModelCall(request, principal, p, "completions", new_id("cmpl", now))
    reply = Reply(call.ref, int(now.timestamp()), p.model.id)

    def render(result: DispatchResult) -> dict[str, Any]:
        answer = {
            **reply.text(result.completion, body, prompts),
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
        }
        return declared(TextCompletion, answer)

    chunks = None
    if body.stream:
        echo = prompts[0] if body.echo else ""
        chunks = Chunks(
            reply=reply,
            object="text_completion",
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            first=lambda i: text_piece(Delta(i, echo)),
            choice=text_piece,
            replayed=text_replay,
        )
    return await call.answer(raw, reqs, render, chunks)


@router.post("/v1/embeddings", summary="Embeddings (OpenAI's shape)")
@declare(EmbeddingList, body=EmbeddingRequest, errors=MODEL_CALL)
async def embeddings(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_embedding)
    texts = as_texts(body.inputs(), "input")
    org_id = principal.org_id
    p = prepared(body.model, lambda: svc.preparer.embeddings(body, texts, org_id=org_id))
    ref = new_id("emb", svc.clock.now())

    async def handler() -> dict[str, Any]:
        await check_tier_limits(request, principal, tokens=p.input_tokens)
        result, charged = await svc.dispatcher.embed(
            org_id=org_id,
            key_id=principal.key_id,
            model=p.model,
            route=p.route,
            texts=texts,
            input_tokens=p.input_tokens,
            max_cost=p.hold,
            price=p.price,
            ref=ref,
        )
        answer = embedding_list(body, p.model.id, result.vectors, result.usage)
        return {**answer, "charge": format_money(charged)}

    return await once(request, principal, raw, handler)
