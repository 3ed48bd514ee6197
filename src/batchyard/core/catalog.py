"""Models, routes and prices: what can be asked for, and who answers it.

A *model* is what a caller names (``kettei-core``), with the direct price the
caller pays per million tokens, its modality, context window and tokenizer. A
*route* is an engine endpoint that serves a model, with its own offered price,
limits and guarantees (hard price caps, data retention). Interactive calls pay
the model's direct price; deferred batches pay a route's offered price when it
meets their discount, which is why both live here side by side.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from batchyard.errors import InvalidRequest, ModelUnavailable, UnknownModel

__all__ = ["CATALOG_CREATED", "Catalog", "ModelSpec", "RouteSpec", "default_catalog"]

#: The ``created`` of models that name none (Unix seconds, 2025-01-01): OpenAI's
#: model objects carry one, and a stable value keeps ``/v1/models`` the same on
#: every call.
CATALOG_CREATED = 1_735_689_600

Modality = Literal["text", "image"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    id: str
    input_per_mtok: Decimal
    output_per_mtok: Decimal
    context_window: int
    modality: tuple[str, ...] = ("text",)
    tokenizer: str = "fallback"
    type: Literal["base", "version"] = "base"
    base_model: str | None = None
    max_output_tokens: int = 4096
    description: str = ""
    created: int = CATALOG_CREATED
    owned_by: str = "batchyard"

    @property
    def reads_images(self) -> bool:
        return "image" in self.modality


@dataclass(frozen=True, slots=True)
class RouteSpec:
    id: str
    model: str
    engine: Literal["llama_cpp", "openai_http"]
    upstream_model: str
    base_url: str | None = None
    api_key_env: str | None = None
    # The route's own offered price; None means it charges the model's direct price.
    input_per_mtok: Decimal | None = None
    output_per_mtok: Decimal | None = None
    # What a prompt token the engine read from its cache costs (never above the
    # input price); None: cached tokens cost what other input tokens cost.
    cached_input_per_mtok: Decimal | None = None
    # Prices come from the catalog ("fixed") or from the operator's price feed ("feed").
    price_source: Literal["fixed", "feed"] = "fixed"
    hard_price_caps: bool = False
    data_retention: Literal["none", "provider"] = "provider"
    rpm: float | None = None
    tpm: float | None = None
    concurrency: int | None = None
    timeout_s: float = 120.0
    fallbacks: tuple[str, ...] = ()
    supports_json_schema: bool = False
    # What the route's engine can do beyond plain chat. ``None`` means the
    # engine's default: the embedded engine does tools (under a grammar) and
    # embeddings (from the chat model itself); an HTTP upstream is only trusted
    # with what its entry says.
    supports_tools: bool | None = None
    supports_streaming: bool = True
    serves_completions: bool = True
    serves_embeddings: bool | None = None
    # Fine-tuned versions served by this route: version model id -> engine extras.
    version: dict[str, Any] = field(default_factory=dict)

    @property
    def tools(self) -> bool:
        return (
            self.supports_tools if self.supports_tools is not None else self.engine == "llama_cpp"
        )

    @property
    def embeddings(self) -> bool:
        if self.serves_embeddings is not None:
            return self.serves_embeddings
        return self.engine == "llama_cpp"


class Catalog:
    """The models and routes of one deployment; immutable once built."""

    def __init__(self, models: Iterable[ModelSpec], routes: Iterable[RouteSpec]) -> None:
        self.models: dict[str, ModelSpec] = {}
        for m in models:
            if m.id in self.models:
                raise ValueError(f"model {m.id!r} declared twice")
            self.models[m.id] = m
        self.routes: dict[str, RouteSpec] = {}
        for r in routes:
            if r.id in self.routes:
                raise ValueError(f"route {r.id!r} declared twice")
            if r.model not in self.models:
                raise ValueError(f"route {r.id!r} serves unknown model {r.model!r}")
            self.routes[r.id] = r
        for r in self.routes.values():
            for fb in r.fallbacks:
                if fb not in self.routes:
                    raise ValueError(f"route {r.id!r} falls back to unknown route {fb!r}")
        for m in self.models.values():
            if m.type == "version" and (m.base_model not in self.models):
                raise ValueError(f"version {m.id!r} needs a known base_model")

    def model(self, model_id: object) -> ModelSpec:
        if not isinstance(model_id, str) or not model_id:
            raise InvalidRequest("model must be a non-empty string", param="model")
        spec = self.models.get(model_id)
        if spec is None:
            raise UnknownModel(
                f"unknown model {model_id!r}; GET /v1/models lists the catalog", param="model"
            )
        return spec

    def routes_for(self, model_id: str) -> list[RouteSpec]:
        return [r for r in self.routes.values() if r.model == model_id]

    def route_for(self, model_id: str) -> RouteSpec:
        """The primary route of a model, or a clear ``model_unavailable``."""
        routes = self.routes_for(model_id)
        if not routes:
            raise ModelUnavailable(
                f"model {model_id!r} has no route configured on this deployment; "
                "an operator adds one under `routes:` in the config file",
                param="model",
            )
        return routes[0]

    def is_available(self, model_id: str) -> bool:
        return bool(self.routes_for(model_id))


def default_catalog() -> Catalog:
    """The catalog a newcomer gets: kettei-core on the embedded model.

    kettei-chub and kettei-fat read images and have no route until an operator
    points one at an engine that can see (answering ``model_unavailable``).
    The embedded route declares hard price caps because its price is fixed
    locally and cannot move, so a first deferred batch qualifies without any
    price feed.
    """
    models = [
        ModelSpec(
            id="kettei-core",
            input_per_mtok=Decimal("0.10"),
            output_per_mtok=Decimal("0.40"),
            context_window=2048,
            modality=("text",),
            tokenizer="default",
            max_output_tokens=1024,
            description="Cheapest; reads text. Served by the embedded SmolLM2-135M-Instruct.",
        ),
        ModelSpec(
            id="kettei-chub",
            input_per_mtok=Decimal("0.50"),
            output_per_mtok=Decimal("2.00"),
            context_window=32768,
            modality=("text", "image"),
            description="Reads text and images.",
        ),
        ModelSpec(
            id="kettei-fat",
            input_per_mtok=Decimal("3.00"),
            output_per_mtok=Decimal("12.00"),
            context_window=131072,
            modality=("text", "image"),
            description="Largest; reads text and images.",
        ),
    ]
    routes = [
        RouteSpec(
            id="embedded",
            model="kettei-core",
            engine="llama_cpp",
            upstream_model="smollm2-135m-instruct",
            input_per_mtok=Decimal("0.005"),
            output_per_mtok=Decimal("0.02"),
            hard_price_caps=True,
            data_retention="none",
        )
    ]
    return Catalog(models, routes)


def _decimal(value: Any, where: str) -> Decimal:
    try:
        d = Decimal(str(value))
    except Exception as exc:
        raise ValueError(f"{where}: not a decimal: {value!r}") from exc
    if not d.is_finite() or d < 0:
        raise ValueError(f"{where}: must be a non-negative decimal")
    return d


def _flag(raw: Mapping[str, Any], name: str) -> bool | None:
    return bool(raw[name]) if raw.get(name) is not None else None


def catalog_from_config(data: Mapping[str, Any]) -> Catalog:
    """Build a catalog from the ``models:`` and ``routes:`` sections of a config file.

    Models named in the file replace or add to the defaults; when ``routes:``
    is given it replaces the default routes entirely, so an operator can turn
    the embedded model off.
    """
    base = default_catalog()
    models = dict(base.models)
    for raw in data.get("models", []) or []:
        mid = str(raw["id"])
        prev = models.get(mid)
        models[mid] = ModelSpec(
            id=mid,
            input_per_mtok=_decimal(
                raw.get("input_per_mtok", prev.input_per_mtok if prev else None), mid
            ),
            output_per_mtok=_decimal(
                raw.get("output_per_mtok", prev.output_per_mtok if prev else None), mid
            ),
            context_window=int(raw.get("context_window", prev.context_window if prev else 4096)),
            modality=tuple(raw.get("modality", prev.modality if prev else ("text",))),
            tokenizer=str(raw.get("tokenizer", prev.tokenizer if prev else "fallback")),
            type=raw.get("type", "base"),
            base_model=raw.get("base_model"),
            max_output_tokens=int(
                raw.get("max_output_tokens", prev.max_output_tokens if prev else 4096)
            ),
            description=str(raw.get("description", prev.description if prev else "")),
            created=int(raw.get("created", prev.created if prev else CATALOG_CREATED)),
            owned_by=str(raw.get("owned_by", prev.owned_by if prev else "batchyard")),
        )
    if "routes" in data:
        routes = []
        for raw in data.get("routes") or []:
            rid = str(raw["id"])
            routes.append(
                RouteSpec(
                    id=rid,
                    model=str(raw["model"]),
                    engine=raw.get("engine", "openai_http"),
                    upstream_model=str(raw.get("upstream_model", raw["model"])),
                    base_url=raw.get("base_url"),
                    api_key_env=raw.get("api_key_env"),
                    input_per_mtok=(
                        _decimal(raw["input_per_mtok"], rid) if "input_per_mtok" in raw else None
                    ),
                    output_per_mtok=(
                        _decimal(raw["output_per_mtok"], rid) if "output_per_mtok" in raw else None
                    ),
                    cached_input_per_mtok=(
                        _decimal(raw["cached_input_per_mtok"], rid)
                        if "cached_input_per_mtok" in raw
                        else None
                    ),
                    price_source=raw.get("price_source", "fixed"),
                    hard_price_caps=bool(raw.get("hard_price_caps", False)),
                    data_retention=raw.get("data_retention", "provider"),
                    rpm=raw.get("rpm"),
                    tpm=raw.get("tpm"),
                    concurrency=raw.get("concurrency"),
                    timeout_s=float(raw.get("timeout_s", 120.0)),
                    fallbacks=tuple(raw.get("fallbacks", ())),
                    supports_json_schema=bool(raw.get("supports_json_schema", False)),
                    supports_tools=_flag(raw, "supports_tools"),
                    supports_streaming=bool(raw.get("supports_streaming", True)),
                    serves_completions=bool(raw.get("serves_completions", True)),
                    serves_embeddings=_flag(raw, "serves_embeddings"),
                    version=dict(raw.get("version", {}) or {}),
                )
            )
    else:
        routes = list(base.routes.values())
    return Catalog(models.values(), routes)
