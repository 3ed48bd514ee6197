"""Models, routes and prices: what can be asked for, and who answers it.

A *model* is what a caller names (``kettei-core``), with the direct price the
caller pays per million tokens, its modality, context window and tokenizer. A
*route* is an engine endpoint that serves a model, with its own offered price,
limits and guarantees (hard price caps, data retention). Interactive calls pay
the model's direct price; deferred batches pay a route's offered price when it
meets their discount, which is why both live here side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from batchyard.errors import InvalidRequest, ModelUnavailable, UnknownModel

__all__ = [
    "CATALOG_CREATED",
    "PROJECT_VERSION_PREFIX",
    "Catalog",
    "ModelSpec",
    "RouteSpec",
    "default_catalog",
    "engine_name",
]

#: The ID prefix of a model version uploaded into a project (``mv.`` + UUIDv7).
PROJECT_VERSION_PREFIX = "mv."

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
    #: A version uploaded into a project belongs to its organisation alone;
    #: catalog models (None) are everyone's.
    organization: str | None = None
    project_id: str | None = None

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
    """The models and routes of one deployment.

    What the config file declares is fixed once built. Versions uploaded into
    projects (``mv.…``) join at run time: ``add_version`` puts one beside its
    base and lists it under the base's routes' ``version`` (how a config file
    declares a served version), and a name this process has not seen yet is
    looked up through ``fetch`` (the store, wired by ``app.build_service``), so
    a version uploaded through another process is found on first use.
    """

    def __init__(self, models: Iterable[ModelSpec], routes: Iterable[RouteSpec]) -> None:
        self._fetch: Callable[[str], tuple[ModelSpec, dict[str, Any]] | None] | None = None
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

    # -- project versions -----------------------------------------------------------

    def fetch_with(self, fetch: Callable[[str], tuple[ModelSpec, dict[str, Any]] | None]) -> None:
        """Where an unseen ``mv.…`` name is looked up: (its spec, its engine extras) or None."""
        self._fetch = fetch

    def add_version(self, spec: ModelSpec, extras: dict[str, Any]) -> None:
        """Serve a project's version on its base's routes, ``extras`` telling the engine how."""
        if spec.base_model not in self.models or spec.type != "version":
            raise ValueError(f"version {spec.id!r} needs a known base_model")
        self.models[spec.id] = spec
        for route in self.routes_for(spec.base_model):
            route.version[spec.id] = dict(extras)

    def remove_version(self, model_id: str) -> None:
        spec = self.models.get(model_id)
        if spec is None or spec.organization is None:
            return
        del self.models[model_id]
        for route in self.routes.values():
            route.version.pop(model_id, None)

    def find(self, model_id: str, org_id: str | None = None) -> ModelSpec | None:
        """The model named ``model_id``, or None; a version of another organisation is None.

        ``org_id`` None (a worker running what a door already checked) sees all.
        """
        spec = self.models.get(model_id)
        if spec is None and model_id.startswith(PROJECT_VERSION_PREFIX) and self._fetch:
            got = self._fetch(model_id)
            if got is not None:
                self.add_version(*got)
                spec = got[0]
        if spec is None:
            return None
        if org_id is not None and spec.organization not in (None, org_id):
            return None
        return spec

    def visible(self, org_id: str | None) -> list[ModelSpec]:
        """The catalog's models and the versions this process knows of ``org_id``'s."""
        return [m for m in self.models.values() if m.organization in (None, org_id)]

    def model(self, model_id: object, org_id: str | None = None) -> ModelSpec:
        if not isinstance(model_id, str) or not model_id:
            raise InvalidRequest("model must be a non-empty string", param="model")
        spec = self.find(model_id, org_id)
        if spec is None:
            raise UnknownModel(
                f"unknown model {model_id!r}; GET /v1/models lists the catalog", param="model"
            )
        return spec

    def routes_for(self, model_id: str) -> list[RouteSpec]:
        """The routes that answer ``model_id``: its own, or, for a version without one,
        its base's routes that list it under ``version`` (a LoRA adapter or full weights)."""
        own = [r for r in self.routes.values() if r.model == model_id]
        spec = self.models.get(model_id)
        if own or spec is None or spec.type != "version" or spec.base_model is None:
            return own
        base = spec.base_model
        return [r for r in self.routes.values() if r.model == base and model_id in r.version]

    def engine_name(self, model_id: str, route: RouteSpec) -> str:
        return engine_name(model_id, route)

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

    def serving(self, model_id: str) -> tuple[RouteSpec, str]:
        """The primary route of ``model_id`` and the name its engine knows it by."""
        route = self.route_for(model_id)
        return route, self.engine_name(model_id, route)

    def is_available(self, model_id: str) -> bool:
        try:
            self.serving(model_id)
        except ModelUnavailable:
            return False
        return True


def engine_name(model_id: str, route: RouteSpec) -> str:
    """The name ``route``'s engine knows ``model_id`` by.

    A route's own model is its ``upstream_model``; a version it lists is the
    version's ``upstream_model`` extra, or its own ID.
    """
    if route.model == model_id:
        return route.upstream_model
    extras = route.version.get(model_id)
    name = extras.get("upstream_model") if isinstance(extras, dict) else None
    return str(name or model_id)


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
