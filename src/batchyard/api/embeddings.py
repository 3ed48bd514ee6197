"""``POST /v1/embeddings``: vectors for texts, billed and limited like chat.

Served by the model's route when its catalog entry says it serves embeddings.
The embedded default serves them from its chat model's own hidden states
(mean-pooled, unit length): real vectors from the shipped model, good enough
to try the endpoint and for rough similarity; a deployment that needs a
trained embedding model points a route at one (``serves_embeddings: true``).

An input may be token ids, as OpenAI takes them: they are read as tiktoken's
``cl100k_base`` ids and embedded as the text they encode (``engines.token_ids``),
so LangChain's ``OpenAIEmbeddings()``, which sends ids by default, gets the
vectors of its texts. The answer is ``work.openai_wire.embedding_list``, which
a file batch's lines share.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.context import check_tier_limits, idempotent
from batchyard.api.openai_door import prepared, read_body
from batchyard.api.openapi import MODEL_CALL, EmbeddingList, declare
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import EmbeddingRequest, parse_embedding
from batchyard.engines.token_ids import as_texts
from batchyard.work.openai_wire import embedding_list

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/embeddings", summary="Embeddings (OpenAI's shape)")
@declare(EmbeddingList, body=EmbeddingRequest, errors=MODEL_CALL)
async def embeddings(request: Request) -> Response:
    principal, raw, svc, body = await read_body(request, parse_embedding)
    texts = as_texts(body.inputs(), "input")
    org_id = principal.org_id
    p = prepared(body.model, lambda: svc.preparer.embeddings(body, texts, org_id=org_id))
    ref = new_id("emb", svc.clock.now())

    async def handler() -> tuple[int, Any]:
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
        return 200, {**answer, "charge": format_money(charged)}

    return await idempotent(request, principal, raw, handler)
