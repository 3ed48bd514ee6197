"""What the model-calling doors share: the body, the prepared call, the call, OpenAI's streams.

``read_body`` authenticates the caller and reads its body strictly;
``prepared`` runs the door's preparation (``service.preparation``: the model
and route, what the route must serve, ``max_tokens``, every token counted, the
window and the quote), with OpenAI's 404 ``model_not_found`` for a name nobody
serves.

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
from batchyard.engines.protocol import CompletionRequest, Delta
from batchyard.errors import BatchyardError, ModelNotFound, UnknownModel
from batchyard.service import Service, model_versions
from batchyard.service.deployment import service_of
from batchyard.service.idempotency import Stream
from batchyard.service.preparation import Prepared
from batchyard.work.dispatcher import DispatchResult
from batchyard.work.openai_wire import Reply

__all__ = ["Chunks", "ModelCall", "prepared", "read_body"]

_Body = TypeVar("_Body")
_Done = TypeVar("_Done")


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

            async def streamed() -> tuple[int, Any]:
                await limits()
                pieces = svc.dispatcher.stream(
                    request=requests[0],
                    input_tokens=call.input_tokens,
                    count_tokens=svc.tokenizer(call.model).count,
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
                each = list(zip(stoppable, call.counts, strict=True))
                try:
                    result = await svc.dispatcher.execute(requests=each, **pay)
                except BatchyardError:
                    if hangup.is_set():
                        log_hangup(self.ref, call.route.id, None)
                    raise
            if hangup.is_set():
                log_hangup(self.ref, call.route.id, result.completion.usage.output_tokens)
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
