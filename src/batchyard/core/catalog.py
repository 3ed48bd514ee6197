"""Models, routes and prices: what can be asked for, and who answers it.

A *model* is what a caller names (``kettei-core``), with the direct price the
caller pays per million tokens, its modality, context window and tokenizer. A
*route* is an engine endpoint that serves a model, with its own offered price,
limits and guarantees (hard price caps, data retention). Interactive calls pay
the model's direct price; deferred batches pay a route's offered price when it
meets their discount, which is why both live here side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from batchyard.core.config_errors import ConfigError, from_validation
from batchyard.errors import InvalidRequest, ModelUnavailable, UnknownModel

__all__ = [
    "CATALOG_CREATED",
    "ENGINES",
    "PROJECT_VERSION_PREFIX",
    "Catalog",
    "ModelEntry",
    "ModelSpec",
    "RouteEntry",
    "RouteSpec",
    "build_catalog",
    "catalog_from_config",
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
    engine: Literal["llama_cpp", "openai_http", "memory"]
    upstream_model: str
    base_url: str | None = None
    api_key_env: str | None = None
    # The route's own offered price; None means it charges the model's direct price.
    input_per_mtok: Decimal | None = None
    output_per_mtok: Decimal | None = None
    # What a prompt token the engine read from its cache costs (capped at the
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

    def embedded_within(self, n_ctx: int) -> Catalog:
        """This catalog with each model the embedded engine serves given at most ``n_ctx`` tokens.

        The embedded engine holds ``embedded_n_ctx`` tokens a sequence, whatever a model's
        entry declares; with the window a call is prepared against (``service.preparation``)
        the smaller of the two, a call the preparation accepts is one the engine can read,
        and ``/v1/models`` shows the window that is really there.
        """
        embedded = {r.model for r in self.routes.values() if r.engine == "llama_cpp"}
        served = [m for m in self.models.values() if embedded & {m.id, m.base_model}]
        if all(m.context_window <= n_ctx for m in served):
            return self
        narrowed = {m.id: replace(m, context_window=min(m.context_window, n_ctx)) for m in served}
        return Catalog([narrowed.get(m.id, m) for m in self.models.values()], self.routes.values())

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


# --- the ``models:`` and ``routes:`` sections of a config file ---------------------------

#: The engine kinds a route may name; ``work.engines`` builds one of each.
ENGINES: tuple[str, ...] = ("llama_cpp", "openai_http", "memory")

_Price = Annotated[Decimal, Field(ge=0, allow_inf_nan=False)]
_Name = Annotated[str, Field(min_length=1)]
_ENTRY = ConfigDict(extra="forbid", coerce_numbers_to_str=True, frozen=True)


class ModelEntry(BaseModel):
    """One entry of ``models:``: a new model, or fields that replace a default model's."""

    model_config = _ENTRY

    id: _Name
    input_per_mtok: _Price | None = None
    output_per_mtok: _Price | None = None
    context_window: PositiveInt | None = None
    modality: tuple[Literal["text", "image"], ...] | None = None
    tokenizer: str | None = None
    type: Literal["base", "version"] = "base"
    base_model: str | None = None
    max_output_tokens: PositiveInt | None = None
    description: str | None = None
    created: NonNegativeInt | None = None
    owned_by: str | None = None


class RouteEntry(BaseModel):
    """One entry of ``routes:`` (see ``RouteSpec`` for what each field means)."""

    model_config = _ENTRY

    id: _Name
    model: _Name
    engine: str = "openai_http"
    upstream_model: str | None = None
    base_url: str | None = None
    api_key_env: str | None = None
    input_per_mtok: _Price | None = None
    output_per_mtok: _Price | None = None
    cached_input_per_mtok: _Price | None = None
    price_source: Literal["fixed", "feed"] = "fixed"
    hard_price_caps: bool = False
    data_retention: Literal["none", "provider"] = "provider"
    rpm: PositiveFloat | None = None
    tpm: PositiveFloat | None = None
    concurrency: PositiveInt | None = None
    timeout_s: PositiveFloat = 120.0
    fallbacks: tuple[str, ...] = ()
    supports_json_schema: bool = False
    supports_tools: bool | None = None
    supports_streaming: bool = True
    serves_completions: bool = True
    serves_embeddings: bool | None = None
    version: dict[str, Any] = Field(default_factory=dict)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value not in ENGINES:
            raise ConfigError(
                "",
                f"unknown engine {value!r} (known: {', '.join(ENGINES)})",
                "fix the route or remove it",
            )
        return value

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ConfigError(
                "",
                f"{value!r} is not an http:// or https:// URL",
                "write the upstream's base URL, such as http://vllm.internal:8000/v1",
            )
        return value


class CatalogSections(BaseModel):
    """``models:`` and ``routes:`` alone, for ``catalog_from_config``."""

    model_config = ConfigDict(extra="ignore")

    models: list[ModelEntry] | None = None
    routes: list[RouteEntry] | None = None


def catalog_from_config(data: Mapping[str, Any]) -> Catalog:
    """Build a catalog from the ``models:`` and ``routes:`` sections of a config file.

    Raises ``ConfigError`` naming the field (``routes[0].engine``).
    """
    try:
        sections = CatalogSections.model_validate(dict(data))
    except ValidationError as exc:
        raise from_validation(exc, model=CatalogSections) from None
    return build_catalog(sections.models or [], sections.routes if "routes" in data else None)


def build_catalog(models: Sequence[ModelEntry], routes: Sequence[RouteEntry] | None) -> Catalog:
    """The catalog of checked entries, every cross-reference checked with its field path.

    Models named in the file replace or add to the defaults (a field left out
    keeps the default model's); when ``routes`` is given (even empty) it
    replaces the default routes entirely, so an operator can turn the
    embedded model off.
    """
    base = default_catalog()
    specs = dict(base.models)
    seen: set[str] = set()
    for i, m in enumerate(models):
        where = f"models[{i}]"
        if m.id in seen:
            raise ConfigError(
                f"{where}.id", f"model {m.id!r} is listed twice", "keep one entry for it"
            )
        seen.add(m.id)
        prev = specs.get(m.id)
        for name in ("input_per_mtok", "output_per_mtok"):
            if getattr(m, name) is None and prev is None:
                raise ConfigError(
                    f"{where}.{name}",
                    f"a new model ({m.id!r}) needs its price",
                    'give it in US dollars per million tokens, such as "0.50"',
                )

        def pick(name: str, default: Any, entry: ModelEntry = m, old: Any = prev) -> Any:
            value = getattr(entry, name)
            if value is not None:
                return value
            return getattr(old, name) if old is not None else default

        specs[m.id] = ModelSpec(
            id=m.id,
            input_per_mtok=pick("input_per_mtok", None),
            output_per_mtok=pick("output_per_mtok", None),
            context_window=pick("context_window", 4096),
            modality=tuple(pick("modality", ("text",))),
            tokenizer=pick("tokenizer", "fallback"),
            type=m.type,
            base_model=m.base_model,
            max_output_tokens=pick("max_output_tokens", 4096),
            description=pick("description", ""),
            created=pick("created", CATALOG_CREATED),
            owned_by=pick("owned_by", "batchyard"),
        )
    for i, m in enumerate(models):
        if m.type == "version" and m.base_model not in specs:
            raise ConfigError(
                f"models[{i}].base_model",
                f"version {m.id!r} needs a known base_model, not {m.base_model!r}",
                f"name one of: {', '.join(sorted(specs))}",
            )
    if routes is None:
        return Catalog(specs.values(), base.routes.values())
    ids = [r.id for r in routes]
    built: list[RouteSpec] = []
    for i, r in enumerate(routes):
        where = f"routes[{i}]"
        if r.id in ids[:i]:
            raise ConfigError(
                f"{where}.id", f"route {r.id!r} is listed twice", "give each route its own id"
            )
        if r.model not in specs:
            raise ConfigError(
                f"{where}.model",
                f"unknown model {r.model!r} (known: {', '.join(sorted(specs))})",
                "name a known model, or add it under models:",
            )
        if r.engine == "openai_http" and not r.base_url:
            raise ConfigError(
                f"{where}.base_url",
                "an openai_http route needs the upstream's base URL",
                "add base_url: http://host:port/v1",
            )
        for j, fb in enumerate(r.fallbacks):
            if fb not in ids:
                raise ConfigError(
                    f"{where}.fallbacks[{j}]",
                    f"falls back to unknown route {fb!r}",
                    "name a route listed under routes:",
                )
        built.append(
            RouteSpec(
                id=r.id,
                model=r.model,
                engine=r.engine,  # type: ignore[arg-type]  # checked against ENGINES
                upstream_model=r.upstream_model or r.model,
                base_url=r.base_url,
                api_key_env=r.api_key_env,
                input_per_mtok=r.input_per_mtok,
                output_per_mtok=r.output_per_mtok,
                cached_input_per_mtok=r.cached_input_per_mtok,
                price_source=r.price_source,
                hard_price_caps=r.hard_price_caps,
                data_retention=r.data_retention,
                rpm=r.rpm,
                tpm=r.tpm,
                concurrency=r.concurrency,
                timeout_s=r.timeout_s,
                fallbacks=r.fallbacks,
                supports_json_schema=r.supports_json_schema,
                supports_tools=r.supports_tools,
                supports_streaming=r.supports_streaming,
                serves_completions=r.serves_completions,
                serves_embeddings=r.serves_embeddings,
                version=dict(r.version),
            )
        )
    return Catalog(specs.values(), built)
