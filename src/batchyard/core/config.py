"""Settings for one deployment: defaults, then the config file, then the environment.

With nothing configured, batchyard keeps its SQLite database in ``~/.batchyard`` (or
``$BATCHYARD_HOME``) and serves the embedded model, so ``batchyard serve`` works on a
fresh machine. Every setting is one field of ``Settings`` or of a section
(``core.sections``): what the code reads, what checks the file and the environment
(``BATCHYARD_<NAME>`` wins over the file), and what docs/reference/configuration.md shows
(``docs/gen_config.py``). A new setting is one field here and nothing else.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AliasChoices,
    Field,
    PositiveInt,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic.fields import FieldInfo

from batchyard.core.catalog import Catalog, ModelEntry, RouteEntry, build_catalog, default_catalog
from batchyard.core.config_errors import ConfigError as ConfigError  # for its old importers
from batchyard.core.config_errors import from_validation
from batchyard.core.sections import (
    SECTION,
    FileBatchSettings,
    FileSettings,
    RunSettings,
    Seconds,
    VersionSettings,
    WebhookSettings,
    setting,
)
from batchyard.core.tiers import DEFAULT_TIERS, Tier, tiers_from_config

__all__ = [
    "ENV_PREFIX",
    "SECTIONS",
    "ConfigError",
    "Settings",
    "default_home",
    "env_names",
    "load_settings",
    "normalise_database_url",
    "scalar_settings",
]

ENV_PREFIX = "BATCHYARD_"


def default_home() -> Path:
    return Path(os.environ.get("BATCHYARD_HOME") or Path.home() / ".batchyard")


_DATABASE_SCHEMES = ("sqlite://", "postgresql://", "postgres://", "postgresql+psycopg://")
_LIMITERS = ("memory", "memory://", "sql")
_LIMITER_SCHEMES = ("redis://", "rediss://", "unix://")
_PRIVACY_MODES = ("off", "redact", "reject")


def _derived(**field: Any) -> Any:
    """A field the code sets (from the home, the catalog's sections), never a file or variable."""
    if "default_factory" not in field:
        field.setdefault("default", None)
    return Field(json_schema_extra={"derived": True}, **field)


def _section(default: Any) -> Any:
    """A section of the file (a list or a mapping), never a variable; left empty, the defaults."""
    return Field(default, json_schema_extra={"section": True})


@dataclass(frozen=True, config=SECTION)
class Settings:
    """Every setting of one deployment: the file's, the environment's and the defaults.

    The fields in ``Settings`` order are the reference page's rows; the
    ``derived`` ones (``home``, ``catalog``, ``config_file``) are set by
    ``load_settings`` and refused in a file. ``dataclasses.replace`` checks
    again, so a test's override is held to the same rules.
    """

    home: Path = _derived(default_factory=default_home)
    #: Where the settings were read from (the config file), for messages.
    config_file: str | None = _derived()
    database_url: str = setting(
        "",
        "`sqlite:///PATH`, `postgresql://…` (`postgres://` and `postgresql+psycopg://` too)",
        shown="`sqlite:///$BATCHYARD_HOME/batchyard.db`",
        flag="--database",
        validate_default=True,
    )
    limiter_url: str | None = setting(
        None,
        "`memory`, `sql` (the database), `redis://…`, `rediss://…`, `unix://…`",
        shown="in-process",
    )
    batch_encryption_key: str | None = setting(
        None,
        "32 random bytes in base64 (`openssl rand -base64 32`); anything else is refused at start",
        shown="SQLite: `batch.key` beside the database, made on first start; PostgreSQL: none",
    )
    idempotency_ttl_s: Seconds = setting(24 * 3600.0, shown="86400 (24 h)")
    max_body_bytes: PositiveInt = setting(4 * 1024 * 1024, shown="4194304 (4 MiB)")
    max_upload_bytes: PositiveInt = setting(
        2 * 1024**3, "a dataset upload's limit", shown="2147483648 (2 GiB)"
    )
    default_max_tokens: PositiveInt = setting(256)
    billing_review_threshold: Annotated[Decimal, Field(ge=0, allow_inf_nan=False)] | None = setting(
        None, "runs quoted above it wait for `batchyard runs approve`", kind="decimal (US dollars)"
    )
    privacy_default: str = setting("off", "`off`, `redact`, `reject`")
    price_feed: str | None = setting(None, "the market's price feed", kind="text (path or URL)")
    price_feed_interval_s: Seconds = setting(60.0)
    price_max_age_s: Seconds = setting(300.0)
    market_policy: str = setting(
        "first_eligible", "`first_eligible`, `deadline_aware` (`-` or `_`)"
    )
    market_interval_s: Seconds = setting(15.0)
    #: How long a dispatched deferred item's lease lasts without a heartbeat.
    market_lease_s: Seconds = setting(120.0)
    embedded_model_path: str | None = setting(
        None,
        "an existing GGUF file",
        kind="text (path)",
        shown="the bundled SmolLM2-135M-Instruct",
        env="BATCHYARD_MODEL_PATH",
    )
    #: Sequences the embedded engine runs at once (``embedded_contexts`` is its old name).
    embedded_slots: Annotated[int, Field(ge=1, le=256)] = setting(
        8,
        "`embedded_contexts` is accepted as its old name",
        validation_alias=AliasChoices("embedded_slots", "embedded_contexts"),
    )
    embedded_n_ctx: Annotated[int, Field(ge=128, le=131072)] = setting(
        2048,
        "also the context window of each model the embedded engine serves, at most",
        kind="integer (tokens)",
    )
    embedded_threads: PositiveInt | None = setting(
        None, "or leave unset for all cores", shown="all cores"
    )
    embedded_prefill_tokens: Annotated[int, Field(ge=16, le=65536)] = setting(
        512, kind="integer (tokens)"
    )
    embedded_cache_tokens: PositiveInt | None = setting(
        None,
        "at least `embedded_n_ctx`",
        kind="integer (tokens)",
        shown="`embedded_slots` × `embedded_n_ctx`",
    )
    embedded_shelf_mb: Annotated[int, Field(ge=0, le=1048576)] = setting(
        256,
        "host memory, per loaded model, for prompts moved out of the KV cache and put back "
        "when a request starts like them (the shelf); 0 turns it off. "
        "`batchyard_embedded_shelf_bytes` in `/metrics` shows what it holds",
        kind="integer (MiB)",
    )
    warm_fallback_after_s: Seconds = setting(10.0)
    #: On SIGTERM, how long calls in flight may take to land before they are cut off.
    shutdown_grace_s: Annotated[float, Field(ge=0)] = setting(30.0, flag="--grace")
    # A request over its organisation's limits that would be admitted within this
    # many seconds waits for its slot on the server instead of answering 429.
    limits_queue_s: Annotated[float, Field(ge=0)] = setting(10.0)
    #: Work with units left whose progress has not moved for this long is stuck:
    #: counted, shown to its owner and listed by ``batchyard stuck``.
    stuck_after_s: Seconds = setting(900.0)
    #: How many times a batch worker sends a line, row or item again when its
    #: upstream answered 503 before taking the call (it never reached the engine),
    #: before the unit counts as failed; 0: never. A call that may have reached
    #: the engine is never sent again.
    upstream_unavailable_retries: Annotated[int, Field(ge=0, le=10)] = setting(2)
    # A concurrency slot's lease, renewed while its request runs: how long a
    # crashed process can hold slots it never gave back.
    slot_lease_s: Seconds = setting(60.0)
    metrics_token: str | None = setting(
        None,
        "any; `/metrics` then wants `Authorization: Bearer <token>`",
        shown="none (open `/metrics`)",
    )
    models: tuple[ModelEntry, ...] = _section(())
    #: None: the built-in routes; a list (even empty) replaces them.
    routes: tuple[RouteEntry, ...] | None = _section(None)
    #: Built from ``models`` and ``routes`` unless given (tests, embedding applications).
    catalog: Catalog = _derived(validate_default=True)
    tiers: tuple[Tier, ...] = _section(DEFAULT_TIERS)
    runs: RunSettings = _section(RunSettings())
    file_batches: FileBatchSettings = _section(FileBatchSettings())
    files: FileSettings = _section(FileSettings())
    model_versions: VersionSettings = _section(VersionSettings())
    webhooks: WebhookSettings = _section(WebhookSettings())

    @property
    def embedded_contexts(self) -> int:
        """The old name of ``embedded_slots``."""
        return self.embedded_slots

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def sqlite_path(self) -> Path | None:
        if not self.is_sqlite:
            return None
        tail = self.database_url.split("///", 1)[-1]
        if not tail or tail == ":memory:":
            return None
        return Path(tail)

    @property
    def version_folder(self) -> Path:
        """Where accepted model versions live: ``model_versions.folder``, or under the home."""
        given = self.model_versions.folder
        return Path(given) if given else self.home / "model-versions"

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            return f"sqlite:///{info.data.get('home', default_home()) / 'batchyard.db'}"
        if not value.startswith(_DATABASE_SCHEMES):
            raise ConfigError(
                "",
                f"{value.split('://')[0]!r} is not a database batchyard can use",
                "use sqlite:///PATH or postgresql://user@host/db",
            )
        return normalise_database_url(value)

    @field_validator("limiter_url")
    @classmethod
    def _limiter(cls, value: str | None) -> str | None:
        if value is not None and value not in _LIMITERS and not value.startswith(_LIMITER_SCHEMES):
            raise ConfigError(
                "",
                f"unknown limiter {value!r}",
                "use memory (one process), sql (the database) or redis://host:6379/0",
            )
        return value

    @field_validator("batch_encryption_key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        from batchyard.core.sealing import SealError, parse_key

        if value is not None:
            try:
                parse_key(value)
            except SealError as exc:
                raise ConfigError(
                    "", str(exc).split(";")[0], "make one with `openssl rand -base64 32`"
                ) from None
        return value

    @field_validator("market_policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        from batchyard.core.market import policy_by_name

        try:
            policy_by_name(value)
        except ValueError as exc:
            raise ConfigError("", str(exc), "use first_eligible or deadline_aware") from None
        return value

    @field_validator("privacy_default")
    @classmethod
    def _privacy(cls, value: str) -> str:
        if value not in _PRIVACY_MODES:
            raise ConfigError(
                "",
                f"unknown privacy mode {value!r} (known: {', '.join(_PRIVACY_MODES)})",
                "use one of those",
            )
        return value

    @field_validator("embedded_model_path")
    @classmethod
    def _model_file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_file():
            raise ConfigError(
                "",
                f"{value!r} is not a file",
                "point it at a GGUF model file, or remove it to use the bundled model",
            )
        return value

    @field_validator("catalog", mode="before")
    @classmethod
    def _catalog(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and ("models" not in info.data or "routes" not in info.data):
            return default_catalog()  # their own error is the one reported
        if value is None:
            value = build_catalog(info.data["models"], info.data["routes"])
        n_ctx = info.data.get("embedded_n_ctx")
        return value.embedded_within(n_ctx) if isinstance(value, Catalog) and n_ctx else value

    @field_validator("tiers", mode="before")
    @classmethod
    def _tiers(cls, value: Any) -> Any:
        if isinstance(value, tuple) and all(isinstance(t, Tier) for t in value):
            return value
        return tiers_from_config(value)

    @field_validator("*", mode="before")
    @classmethod
    def _empty(cls, value: Any, info: ValidationInfo) -> Any:
        """A section written with nothing under it (``runs:``) is the defaults."""
        if value is None and info.field_name in SECTIONS:
            return _FIELDS[info.field_name].get_default(call_default_factory=True)
        return value

    @model_validator(mode="after")
    def _agree(self) -> Settings:
        """What no single field can say: values that must agree."""
        cache, n_ctx = self.embedded_cache_tokens, self.embedded_n_ctx
        if cache is not None and cache < n_ctx:
            raise ConfigError(
                "embedded_cache_tokens",
                f"is {cache}, less than one sequence (embedded_n_ctx: {n_ctx})",
                f"raise it to at least {n_ctx}, or remove it for slots x n_ctx "
                f"({self.embedded_slots * n_ctx})",
            )
        return self


_SETTINGS = TypeAdapter(Settings)


def normalise_database_url(url: str) -> str:
    """Accept plain ``postgresql://`` and use the psycopg 3 driver for it."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


_FIELDS: dict[str, FieldInfo] = Settings.__pydantic_fields__  # type: ignore[attr-defined]


def _extra(info: FieldInfo) -> dict[str, Any]:
    extra = info.json_schema_extra
    return dict(extra) if isinstance(extra, dict) else {}


#: The settings that are sections of the file, never a variable.
SECTIONS = tuple(name for name, info in _FIELDS.items() if _extra(info).get("section"))


def scalar_settings() -> Iterator[tuple[str, FieldInfo]]:
    """The top-level settings a file or a variable may give one value (not the sections)."""
    for name, info in _FIELDS.items():
        if not _extra(info).get("derived") and name not in SECTIONS:
            yield name, info


def env_names(name: str) -> tuple[str, ...]:
    """The environment variables of a top-level setting, the first its own (the rest old names)."""
    info = _FIELDS[name]
    own = str(_extra(info).get("env") or ENV_PREFIX + name.upper())
    return (own, *(ENV_PREFIX + a.upper() for a in _aliases(name) if a != name))


def _aliases(name: str) -> tuple[str, ...]:
    info = _FIELDS.get(name)
    alias = info.validation_alias if info is not None else None
    return tuple(str(a) for a in alias.choices) if isinstance(alias, AliasChoices) else (name,)


def _canonical(key: str) -> str:
    """A field's name from any of its names (``embedded_contexts`` is ``embedded_slots``)."""
    for name in _FIELDS:
        if key in _aliases(name):
            return name
    return key


def _read_file(path: Path) -> dict[str, Any]:
    where = str(path)
    said: tuple[str, str] | None = None  # what is wrong with the file, and the fix
    try:
        text = path.read_text(encoding="utf-8")
        data: Any = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except FileNotFoundError:
        said = ("the config file does not exist", "check --config or BATCHYARD_CONFIG")
    except (OSError, UnicodeDecodeError) as exc:
        said = (f"the config file cannot be read ({exc})", "make it a readable UTF-8 file")
    except tomllib.TOMLDecodeError as exc:
        said = (f"not valid TOML: {exc}", "fix the syntax at that line")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        said = (f"not valid YAML{at}: {problem}", "fix the syntax there")
    if said is not None:
        raise ConfigError("", *said).at(where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            "",
            f"the file holds a {type(data).__name__}, not settings",
            "write `name: value` lines at the top level (see docs/reference/configuration.md)",
        ).at(where)
    for key in data:
        if key in _FIELDS and _extra(_FIELDS[key]).get("derived"):
            raise ConfigError(
                str(key), "is not a setting batchyard knows", "remove it or fix its name"
            ).at(where)
    return {str(k): v for k, v in data.items()}


def load_settings(
    *,
    config_file: str | os.PathLike[str] | None = None,
    database_url: str | None = None,
    **overrides: Any,
) -> Settings:
    """The settings of this process; raises ``ConfigError`` (with its source) on a bad value.

    Each layer wins over the one before: the defaults, the config file
    (``config_file`` or ``BATCHYARD_CONFIG``), the environment, then the
    arguments (``database_url`` from ``--database``; ``overrides``, any field,
    from tests and benchmarks).
    """
    config_file = config_file or os.environ.get("BATCHYARD_CONFIG") or None
    source = str(config_file) if config_file else None
    given: dict[str, Any] = {"config_file": source}
    origin: dict[str, str] = {}
    shadowed: list[tuple[str, Any, str]] = []  # a value a later layer replaced, and its source

    def layer(key: str, value: Any, where: str) -> None:
        name = _canonical(key)
        for alias in _aliases(name):
            if alias in given and name in origin:
                shadowed.append((alias, given[alias], origin[name]))
            given.pop(alias, None)
        given[key] = value  # as written: an error names the name the operator used
        origin[name] = where

    if source is not None:
        for key, value in _read_file(Path(source)).items():
            layer(key, value, source)
    for name, _ in scalar_settings():
        # A setting's first variable that is set (an empty one is an unset one).
        var = next((var for var in env_names(name) if os.environ.get(var)), None)
        if var is not None:
            layer(name, os.environ[var], f"environment variable {var}")
    if database_url:
        via_env = os.environ.get("BATCHYARD_DATABASE_URL") == database_url
        where = "environment variable BATCHYARD_DATABASE_URL" if via_env else "--database"
        layer("database_url", database_url, where)
    for key, value in overrides.items():
        layer(key, value, "the arguments")
    try:
        settings = _SETTINGS.validate_python(given)
    except ValidationError as exc:
        error = from_validation(exc, model=Settings)
        raise error.at(origin.get(_top(error.field)) or source or "the settings") from None
    for key, value, where in shadowed:
        # A mistake stays one where a later layer overrides it (the file's typo under
        # ``--database``): it would surface the day the override goes.
        name = _canonical(key)
        trial = {k: v for k, v in given.items() if _canonical(k) != name}
        try:
            _SETTINGS.validate_python({**trial, key: value})
        except ValidationError as exc:
            raise from_validation(exc, model=Settings).at(where) from None
    return settings


def _top(field: str) -> str:
    """The top-level setting of a field path (``routes`` of ``routes[0].engine``)."""
    return field.split(".", 1)[0].split("[", 1)[0]
