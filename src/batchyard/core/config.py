"""Settings for one deployment: defaults, then the config file, then the environment.

With nothing configured, batchyard keeps its SQLite database (and the batch
encryption key it makes) in ``~/.batchyard`` (or ``$BATCHYARD_HOME``) and
serves kettei-core from the embedded model, so ``batchyard serve`` works on a
fresh machine. Every operator command reads ``BATCHYARD_DATABASE_URL`` and
``BATCHYARD_CONFIG`` so the CLI and the server agree on where the data is.

Every setting is one field of ``SettingsFile``, a typed model that checks the
file and the environment alike: each top-level scalar can also be set as
``BATCHYARD_<NAME>`` (``BATCHYARD_SHUTDOWN_GRACE_S``), which wins over the
file. A wrong value anywhere is a ``ConfigError`` that names where it came
from and the field (``routes[0].engine``), which the CLI prints as one line;
values used to be read by hand (``float(data.get(...))``), so a typo was a
traceback at start or a 500 on every call. A new setting is one field here
(and a row in docs/reference/configuration.md). ``Settings``, what the rest of
the code reads, keeps its attributes.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from batchyard.core.catalog import Catalog, ModelEntry, RouteEntry, build_catalog
from batchyard.core.config_errors import ConfigError, from_validation
from batchyard.core.tiers import DEFAULT_TIERS, Tier, TierEntry, build_tiers

__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "Settings",
    "SettingsFile",
    "default_home",
    "env_var",
    "load_settings",
]

ENV_PREFIX = "BATCHYARD_"


def default_home() -> Path:
    return Path(os.environ.get("BATCHYARD_HOME") or Path.home() / ".batchyard")


@dataclass(frozen=True)
class Settings:
    database_url: str
    home: Path
    catalog: Catalog
    tiers: tuple[Tier, ...] = DEFAULT_TIERS
    limiter_url: str | None = None
    idempotency_ttl_s: float = 24 * 3600
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 256
    billing_review_threshold: Decimal | None = None
    batch_encryption_key: str | None = None
    price_feed: str | None = None
    price_feed_interval_s: float = 60.0
    price_max_age_s: float = 300.0
    market_policy: str = "first_eligible"
    market_interval_s: float = 15.0
    # How long a dispatched deferred item's lease lasts without a heartbeat.
    market_lease_s: float = 120.0
    embedded_model_path: str | None = None
    #: Sequences the embedded engine runs at once (``embedded_contexts`` is its old name).
    embedded_slots: int = 8
    #: One sequence's context window on the embedded engine, in tokens.
    embedded_n_ctx: int = 2048
    #: CPU threads of the embedded engine; None: all cores.
    embedded_threads: int | None = None
    #: Prompt tokens the embedded engine evaluates per step.
    embedded_prefill_tokens: int = 512
    #: The embedded engine's shared KV cache in tokens; None: slots x n_ctx.
    embedded_cache_tokens: int | None = None
    #: Host memory (MiB) for prompts moved out of the embedded engine's KV cache
    #: and put back when a request starts like them (the shelf); 0: none.
    embedded_shelf_mb: int = 256
    warm_fallback_after_s: float = 10.0
    #: On SIGTERM, how long calls in flight may take to land before they are cut off.
    shutdown_grace_s: float = 30.0
    # A request over its organisation's limits that would be admitted within this
    # many seconds waits for its slot on the server instead of answering 429.
    limits_queue_s: float = 10.0
    #: Work with units left whose progress has not moved for this long is stuck:
    #: counted, shown to its owner and listed by ``batchyard stuck``.
    stuck_after_s: float = 900.0
    # A concurrency slot's lease, renewed while its request runs: how long a
    # crashed process can hold slots it never gave back.
    slot_lease_s: float = 60.0
    #: When set, ``/metrics`` answers only ``Authorization: Bearer <metrics_token>``.
    metrics_token: str | None = None
    #: Where the settings were read from (the config file), for messages.
    config_file: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

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


# --- the typed model of the file and the environment -------------------------------------

_Seconds = PositiveFloat
_Section = ConfigDict(extra="forbid", frozen=True)


class RunsSection(BaseModel):
    """``runs:``: timings of batch inference runs (``core.runs.RunSettings``)."""

    model_config = _Section

    quote_ttl_s: _Seconds | None = None
    lease_s: _Seconds | None = None
    heartbeat_s: _Seconds | None = None
    poll_s: _Seconds | None = None
    flush_s: _Seconds | None = None
    concurrency: PositiveInt | None = None
    max_active_runs: PositiveInt | None = None
    prepare_batch: PositiveInt | None = None
    write_batch: PositiveInt | None = None
    failure_streak: PositiveInt | None = None


class FileBatchesSection(BaseModel):
    """``file_batches:``: the file-batch worker (``work.file_batches.FileBatchSettings``)."""

    model_config = _Section

    poll_s: _Seconds | None = None
    lease_s: _Seconds | None = None
    flush_s: _Seconds | None = None
    concurrency: PositiveInt | None = None
    max_active: PositiveInt | None = None
    end_chunk: PositiveInt | None = None


class FilesSection(BaseModel):
    """``files:``: upload limits (``service.files.FileSettings``)."""

    model_config = _Section

    max_bytes: PositiveInt | None = None
    max_lines: PositiveInt | None = None
    max_line_bytes: PositiveInt | None = None
    max_custom_id: PositiveInt | None = None


class ModelVersionsSection(BaseModel):
    """``model_versions:``: uploaded versions (``service.model_versions.VersionSettings``)."""

    model_config = _Section

    max_lora_bytes: PositiveInt | None = None
    max_weights_bytes: PositiveInt | None = None
    folder: str | None = None
    #: How long a version stays loaded after its last request (keep-warm aside).
    idle_s: _Seconds | None = None
    #: The memory the loaded versions may hold together; unset: no budget.
    memory_budget_bytes: PositiveInt | None = None


class WebhooksSection(BaseModel):
    """``webhooks:``: where deliveries may go and how they are retried (``core.webhook_rules``)."""

    model_config = _Section

    #: CIDR blocks a webhook URL may reach besides public addresses (SSRF allow-list).
    allowed_networks: list[str] | None = None
    timeout_s: _Seconds | None = None
    max_attempts: PositiveInt | None = None
    base_delay_s: _Seconds | None = None
    max_delay_s: _Seconds | None = None
    jitter: Annotated[float, Field(ge=0, lt=1)] | None = None
    concurrency: PositiveInt | None = None
    lease_s: _Seconds | None = None
    poll_s: _Seconds | None = None
    flush_s: _Seconds | None = None

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str] | None) -> list[str] | None:
        from batchyard.core.webhook_rules import parse_networks

        try:
            parse_networks(value or ())
        except ValueError as exc:
            raise ConfigError(
                "", str(exc), "give CIDR blocks such as 10.0.0.0/8 or 127.0.0.0/8"
            ) from None
        return value


_DATABASE_SCHEMES = ("sqlite://", "postgresql://", "postgres://", "postgresql+psycopg://")
_LIMITERS = ("memory", "memory://", "sql")
_LIMITER_SCHEMES = ("redis://", "rediss://", "unix://")
_PRIVACY_MODES = ("off", "redact", "reject")


class SettingsFile(BaseModel):
    """Every setting a config file (or ``BATCHYARD_<NAME>``) may give, checked.

    docs/reference/configuration.md lists each with its type, default and
    variable; a test keeps the two the same.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    database_url: str | None = None
    limiter_url: str | None = None
    idempotency_ttl_s: _Seconds = 24 * 3600
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    max_upload_bytes: PositiveInt = 2 * 1024**3
    default_max_tokens: PositiveInt = 256
    billing_review_threshold: Annotated[Decimal, Field(ge=0, allow_inf_nan=False)] | None = None
    batch_encryption_key: str | None = None
    privacy_default: str = "off"
    price_feed: str | None = None
    price_feed_interval_s: _Seconds = 60.0
    price_max_age_s: _Seconds = 300.0
    market_policy: str = "first_eligible"
    market_interval_s: _Seconds = 15.0
    market_lease_s: _Seconds = 120.0
    embedded_model_path: str | None = None
    embedded_slots: Annotated[int, Field(ge=1, le=256)] = Field(
        default=8, validation_alias=AliasChoices("embedded_slots", "embedded_contexts")
    )
    embedded_n_ctx: Annotated[int, Field(ge=128, le=131072)] = 2048
    embedded_threads: PositiveInt | None = None
    embedded_prefill_tokens: Annotated[int, Field(ge=16, le=65536)] = 512
    embedded_cache_tokens: PositiveInt | None = None
    embedded_shelf_mb: Annotated[int, Field(ge=0, le=1048576)] = 256
    warm_fallback_after_s: _Seconds = 10.0
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0
    limits_queue_s: Annotated[float, Field(ge=0)] = 10.0
    stuck_after_s: _Seconds = 900.0
    slot_lease_s: _Seconds = 60.0
    metrics_token: str | None = None
    models: list[ModelEntry] | None = None
    routes: list[RouteEntry] | None = None
    tiers: list[TierEntry] | None = None
    runs: RunsSection | None = None
    file_batches: FileBatchesSection | None = None
    files: FilesSection | None = None
    model_versions: ModelVersionsSection | None = None
    webhooks: WebhooksSection | None = None

    @field_validator("database_url")
    @classmethod
    def _database(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(_DATABASE_SCHEMES):
            raise ConfigError(
                "",
                f"{value.split('://')[0]!r} is not a database batchyard can use",
                "use sqlite:///PATH or postgresql://user@host/db",
            )
        return value

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


#: Environment variables that are not ``BATCHYARD_<FIELD>`` (kept from before the model).
_ENV_NAMES = {"embedded_model_path": "BATCHYARD_MODEL_PATH"}
_ENV_ALIASES = {"embedded_slots": ("BATCHYARD_EMBEDDED_CONTEXTS",)}
_SECTIONS = frozenset(
    {"models", "routes", "tiers", "runs", "file_batches", "files", "model_versions", "webhooks"}
)


def env_var(name: str) -> str | None:
    """The environment variable of a top-level setting (None for the sections)."""
    if name in _SECTIONS:
        return None
    return _ENV_NAMES.get(name, ENV_PREFIX + name.upper())


def _environment() -> dict[str, tuple[str, str]]:
    """Settings given as environment variables: field -> (variable, value)."""
    found: dict[str, tuple[str, str]] = {}
    for name in SettingsFile.model_fields:
        var = env_var(name)
        if var is None:
            continue
        for candidate in (var, *_ENV_ALIASES.get(name, ())):
            value = os.environ.get(candidate)
            if value:  # an empty variable is an unset one
                found[name] = (candidate, value)
                break
    return found


def _read_file(path: Path) -> dict[str, Any]:
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            "", "the config file does not exist", "check --config or BATCHYARD_CONFIG"
        ).at(where) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "", f"the config file cannot be read ({exc})", "make it a readable UTF-8 file"
        ).at(where) from None
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"not valid TOML: {exc}", "fix the syntax at that line").at(
            where
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("", f"not valid YAML{at}: {problem}", "fix the syntax there").at(
            where
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            "",
            f"the file holds a {type(data).__name__}, not settings",
            "write `name: value` lines at the top level (see docs/reference/configuration.md)",
        ).at(where)
    return {str(k): v for k, v in data.items()}


def normalise_database_url(url: str) -> str:
    """Accept plain ``postgresql://`` and use the psycopg 3 driver for it."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _check(model: SettingsFile) -> None:
    """What no single field can say: values that must agree."""
    slots_x_ctx = model.embedded_slots * model.embedded_n_ctx
    if model.embedded_cache_tokens is not None and model.embedded_cache_tokens < (
        model.embedded_n_ctx
    ):
        raise ConfigError(
            "embedded_cache_tokens",
            f"is {model.embedded_cache_tokens}, less than one sequence "
            f"(embedded_n_ctx: {model.embedded_n_ctx})",
            f"raise it to at least {model.embedded_n_ctx}, or remove it for slots x n_ctx "
            f"({slots_x_ctx})",
        )


def load_settings(
    *,
    config_file: str | os.PathLike[str] | None = None,
    database_url: str | None = None,
    **overrides: Any,
) -> Settings:
    """The settings of this process; raises ``ConfigError`` (with its source) on a bad value.

    ``overrides`` replace fields of the result (tests, benchmarks);
    ``embedded_contexts`` is taken as ``embedded_slots``.
    """
    home = default_home()
    config_file = config_file or os.environ.get("BATCHYARD_CONFIG") or None
    source = str(config_file) if config_file else None
    data = _read_file(Path(config_file)) if config_file else {}
    given = dict(data)
    env = _environment()
    origin: dict[str, str] = {}
    for name, (var, value) in env.items():
        for key in (name, *(("embedded_contexts",) if name == "embedded_slots" else ())):
            given.pop(key, None)
        given[name] = value
        origin[name] = f"environment variable {var}"
    try:
        model = SettingsFile.model_validate(given)
        _check(model)
    except ValidationError as exc:
        error = from_validation(exc, model=SettingsFile)
        top = error.field.split(".", 1)[0].split("[", 1)[0]
        raise error.at(origin.get(top, source or "the settings")) from None
    except ConfigError as exc:
        top = exc.field.split(".", 1)[0].split("[", 1)[0]
        raise exc.at(origin.get(top, source or "the settings")) from None
    try:
        catalog = build_catalog(model.models or [], model.routes if "routes" in data else None)
        tiers = build_tiers(model.tiers or [])
    except ConfigError as exc:
        raise exc.at(source or "the settings") from None
    url = database_url or model.database_url or f"sqlite:///{home / 'batchyard.db'}"
    taken = {
        f.name: getattr(model, f.name)
        for f in fields(Settings)
        if f.name in SettingsFile.model_fields and f.name not in ("database_url", "tiers")
    }
    taken.pop("catalog", None)
    settings = Settings(
        database_url=normalise_database_url(str(url)),
        home=home,
        catalog=catalog,
        tiers=tiers,
        config_file=source,
        raw=_raw(data, model),
        **taken,
    )
    if "embedded_contexts" in overrides:
        overrides["embedded_slots"] = overrides.pop("embedded_contexts")
    return replace(settings, **overrides) if overrides else settings


def _raw(data: dict[str, Any], model: SettingsFile) -> dict[str, Any]:
    """The file's sections, checked, as the parts that read ``settings.raw`` expect them."""
    raw = dict(data)
    for name in ("runs", "file_batches", "files", "model_versions", "webhooks"):
        section = getattr(model, name)
        if section is not None:
            raw[name] = section.model_dump(exclude_none=True)
    raw["max_upload_bytes"] = model.max_upload_bytes
    raw["privacy_default"] = model.privacy_default
    return raw
