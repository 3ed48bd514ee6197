"""The default catalog with a cached-input price on the embedded model's routes."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from typing import Any

from batchyard.core.catalog import Catalog, default_catalog
from batchyard.core.prices import Price

#: US dollars per million prompt tokens read from the engine's cache: well under the input price.
CACHED_PER_MTOK = Decimal("0.001")


def cached_catalog(cached_per_mtok: Decimal = CACHED_PER_MTOK) -> Catalog:
    """Every route of the embedded engine charges ``cached_per_mtok`` for a cached token."""
    base = default_catalog()
    routes = [
        dataclasses.replace(r, cached_input_per_mtok=cached_per_mtok)
        if r.engine == "llama_cpp"
        else r
        for r in base.routes.values()
    ]
    return Catalog(list(base.models.values()), routes)


def settled(
    catalog: Catalog, model_id: str, usage: dict[str, Any], price: Price | None = None
) -> Decimal:
    """What OpenAI-shaped ``usage`` costs at ``price`` (the model's own by default).

    Cached tokens cost the route's cached-input price (capped at ``price``'s input price).
    """
    model = catalog.model(model_id)
    [route] = [r for r in catalog.routes.values() if r.model == model_id]
    price = price or Price(model.input_per_mtok, model.output_per_mtok)
    price = price.for_route(route.cached_input_per_mtok)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return price.cost(usage["prompt_tokens"], usage["completion_tokens"], cached)
