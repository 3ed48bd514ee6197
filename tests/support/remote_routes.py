"""A catalog of one model, ``remote-model``, routed to an OpenAI-compatible upstream."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from batchyard.core.catalog import Catalog, catalog_from_config


def remote_catalog(
    base_url: str,
    *,
    input_per_mtok: Decimal | str = "1",
    output_per_mtok: Decimal | str = "2",
    **route: Any,
) -> Catalog:
    """``remote-model`` at the given prices, one ``openai_http`` route to ``base_url``.

    ``route`` adds to (or replaces) the route's fields: ``upstream_model``,
    ``timeout_s``, ``cached_input_per_mtok``, ...
    """
    return catalog_from_config(
        {
            "models": [
                {
                    "id": "remote-model",
                    "input_per_mtok": str(input_per_mtok),
                    "output_per_mtok": str(output_per_mtok),
                    "context_window": 4096,
                    "max_output_tokens": 512,
                }
            ],
            "routes": [
                {
                    "id": "remote",
                    "model": "remote-model",
                    "engine": "openai_http",
                    "base_url": base_url,
                    **route,
                }
            ],
        }
    )
