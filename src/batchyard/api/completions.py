"""``POST /v1/completions``: OpenAI's (legacy) text completions, billed and limited like chat.

The prompt goes to the model as it is, with no chat template; ``n`` samples
of it are answered and billed like chat's. A list of prompts is answered as
OpenAI does, one choice per prompt × ``n`` in order (prompt ``i``'s samples
are choices ``i*n`` to ``i*n+n-1``), and is one call to its caller: one tier
check, one hold for the whole list, one charge. A prompt of token ids is read
as ``cl100k_base`` ids (``engines.token_ids``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.context import authenticate, check_tier_limits, idempotent, read_json
from batchyard.api.openai_door import StreamShape, resolve, sse_response
from batchyard.core.ids import new_id
from batchyard.core.money import format_money
from batchyard.core.openai_bodies import parse_completion
from batchyard.core.quotes import check_context, direct_price, quote
from batchyard.engines.base import Choice, CompletionRequest, Delta
from batchyard.engines.token_ids import as_texts
from batchyard.errors import CapabilityUnsupported, InvalidRequest
from batchyard.service.deployment import service_of
from batchyard.work.dispatcher import DispatchResult

__all__ = ["router"]

router = APIRouter()


def _logprobs(ch: Choice, wanted: bool) -> dict[str, Any] | None:
    if not wanted or ch.logprobs is None:
        return None
    return {
        "tokens": [lp["token"] for lp in ch.logprobs],
        "token_logprobs": [lp["logprob"] for lp in ch.logprobs],
        "top_logprobs": [
            {alt["token"]: alt["logprob"] for alt in lp.get("top_logprobs") or []}
            for lp in ch.logprobs
        ],
        "text_offset": [],
    }


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    svc = service_of(request)
    body = parse_completion(raw)
    prompts = as_texts(body.prompts(), "prompt")
    if body.stream and len(prompts) > 1:
        raise CapabilityUnsupported(
            "a stream answers one prompt; send the list without stream", param="stream"
        )
    model, route = resolve(
        svc,
        body.model,
        "completions",
        *(["stream"] if body.stream else []),
        org_id=principal.org_id,
    )
    max_tokens = body.max_tokens or 16
    if max_tokens > model.max_output_tokens:
        raise InvalidRequest(
            f"max_tokens can be at most {model.max_output_tokens} for {model.id}",
            param="max_tokens",
            code="max_tokens_out_of_range",
        )
    tok = svc.tokenizer(model)
    # Each prompt and the start-of-text token the model reads first.
    counts = [n + 1 for n in tok.count_batch(prompts)]
    for i, count in enumerate(counts):
        check_context(
            model, count, max_tokens, param="prompt" if len(prompts) == 1 else f"prompt.{i}"
        )
    input_tokens = sum(counts)
    price = direct_price(model)
    max_cost = quote(model, input_tokens, max_tokens, body.n * len(prompts))
    wants_logprobs = body.logprobs is not None
    reqs = [
        CompletionRequest(
            model=svc.catalog.engine_name(model.id, route),
            messages=[{"role": "user", "content": prompt}],
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            n=body.n,
            stop=body.stop_list(),
            seed=body.seed,
            logprobs=wants_logprobs,
            top_logprobs=body.logprobs,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
        )
        for prompt in prompts
    ]
    req = reqs[0]
    now = svc.clock.now()
    call_id = new_id("cmpl", now)
    created = int(now.timestamp())
    echo = prompts[0] if body.echo else ""

    def echoed(i: int) -> str:
        """The prompt of choice ``i`` where it is echoed: choices go prompt by prompt."""
        return prompts[i // body.n] if body.echo else ""

    def whole(result: DispatchResult) -> dict[str, Any]:
        u = result.completion.usage
        return {
            "id": call_id,
            "object": "text_completion",
            "created": created,
            "model": model.id,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": i,
                    "text": echoed(i) + ch.text,
                    "finish_reason": ch.finish_reason,
                    "logprobs": _logprobs(ch, wants_logprobs),
                }
                for i, ch in enumerate(result.completion.choices)
            ],
            "usage": {
                "prompt_tokens": u.input_tokens,
                "completion_tokens": u.output_tokens,
                "total_tokens": u.total_tokens,
                **(
                    {"prompt_tokens_details": {"cached_tokens": u.cached_input_tokens}}
                    if u.cached_input_tokens
                    else {}
                ),
            },
            "charge": format_money(result.charge),
            "reservation_id": result.reservation_id,
        }

    async def limits() -> None:
        await check_tier_limits(request, principal, requests=1, tokens=input_tokens)

    if body.stream:
        return await sse_response(
            request,
            svc,
            principal,
            raw,
            call_id=call_id,
            created=created,
            model=model.id,
            n=body.n,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            shape=StreamShape(
                object="text_completion",
                first=lambda i: _text_piece(Delta(i, echo)),
                piece=_text_piece,
                replay=lambda saved: [{**c, "logprobs": None} for c in saved.get("choices", [])],
                whole=whole,
            ),
            start=lambda: svc.dispatcher.stream(
                org_id=principal.org_id,
                model=model,
                route=route,
                request=req,
                input_tokens=input_tokens,
                max_cost=max_cost,
                price=price,
                purpose="completions",
                count_tokens=tok.count,
                ref=call_id,
            ),
            before=limits,
        )

    async def handler() -> tuple[int, Any]:
        await limits()
        if len(reqs) > 1:
            result = await svc.dispatcher.execute_all(
                org_id=principal.org_id,
                model=model,
                route=route,
                requests=list(zip(reqs, counts, strict=True)),
                max_cost=max_cost,
                price=price,
                purpose="completions",
                ref=call_id,
            )
            return 200, whole(result)
        result = await svc.dispatcher.execute(
            org_id=principal.org_id,
            model=model,
            route=route,
            request=req,
            input_tokens=input_tokens,
            max_cost=max_cost,
            price=price,
            purpose="completions",
            ref=call_id,
        )
        return 200, whole(result)

    return await idempotent(request, principal, raw, handler)


def _text_piece(d: Delta) -> dict[str, Any]:
    return {"index": d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
