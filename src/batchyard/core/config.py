"""Settings for one deployment: defaults, then the config file, then the environment.

With nothing configured, batchyard keeps its SQLite database (and the batch
encryption key it makes) in ``~/.batchyard`` (or ``$BATCHYARD_HOME``) and
serves kettei-core from the embedded model, so ``batchyard serve`` works on a
fresh machine. Every operator command reads ``BATCHYARD_DATABASE_URL`` and
``BATCHYARD_CONFIG`` so the CLI and the server agree on where the data is.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from batchyard.core.catalog import Catalog, catalog_from_config
from batchyard.core.tiers import DEFAULT_TIERS, Tier, tiers_from_config

__all__ = ["Settings", "default_home", "load_settings"]


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
    # How long a tombstone of an expired key is kept (answers
    # idempotency_response_expired) before the key may be forgotten.
    idempotency_tombstone_s: float = 30 * 24 * 3600
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
    #: Requests the embedded model runs at once (its scheduler's sequences).
    embedded_slots: int = 8
    #: The old name of ``embedded_slots``, still accepted; always equal to it.
    embedded_contexts: int = 8
    #: Context (prompt and answer) of one sequence, in tokens.
    embedded_n_ctx: int = 2048
    #: Threads of the embedded model's decode; ``None``: every core.
    embedded_threads: int | None = None
    #: Prompt tokens read per scheduler step, beside the tokens being generated.
    embedded_prefill_tokens: int = 512
    #: KV cache cells, sized up front and shared by all sequences; ``None``: slots × n_ctx.
    embedded_cache_tokens: int | None = None
    warm_fallback_after_s: float = 10.0
    #: On SIGTERM, how long calls in flight may take to land before they are cut off.
    shutdown_grace_s: float = 30.0
    # A request over its organisation's limits that would be admitted within this
    # many seconds waits for its slot on the server instead of answering 429.
    limits_queue_s: float = 10.0
    # A concurrency slot's lease, renewed while its request runs: how long a
    # crashed process can hold slots it never gave back.
    slot_lease_s: float = 60.0
    #: When set, ``/metrics`` answers only ``Authorization: Bearer <metrics_token>``.
    metrics_token: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

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


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    data = tomllib.loads(text) if path.suffix == ".toml" else (yaml.safe_load(text) or {})
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must hold a mapping")
    return data


def normalise_database_url(url: str) -> str:
    """Accept plain ``postgresql://`` and use the psycopg 3 driver for it."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


_EMBEDDED_INTS = {
    # field: (environment variable, least value)
    "embedded_slots": ("BATCHYARD_EMBEDDED_SLOTS", 1),
    "embedded_n_ctx": ("BATCHYARD_EMBEDDED_N_CTX", 64),
    "embedded_threads": ("BATCHYARD_EMBEDDED_THREADS", 1),
    "embedded_prefill_tokens": ("BATCHYARD_EMBEDDED_PREFILL_TOKENS", 16),
    "embedded_cache_tokens": ("BATCHYARD_EMBEDDED_CACHE_TOKENS", 64),
}


def _embedded(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The embedded engine's sizes from the file and the environment, checked."""
    if "embedded_slots" not in data and "embedded_contexts" in data:
        data = {**data, "embedded_slots": data["embedded_contexts"]}
    out: dict[str, Any] = {}
    for name, (env, least) in _EMBEDDED_INTS.items():
        raw = os.environ.get(env)
        source = env if raw else f"{where} field {name}"
        value = raw if raw else data.get(name)
        if value is None:
            continue
        try:
            number = int(str(value))
        except ValueError:
            number = least - 1
        if number < least or isinstance(value, bool | float):
            raise ValueError(f"{source}: {value!r} is not a whole number >= {least}")
        out[name] = number
    if "embedded_slots" in out:
        out["embedded_contexts"] = out["embedded_slots"]
    return out


def load_settings(
    *,
    config_file: str | os.PathLike[str] | None = None,
    database_url: str | None = None,
    **overrides: Any,
) -> Settings:
    home = default_home()
    config_file = config_file or os.environ.get("BATCHYARD_CONFIG")
    data: dict[str, Any] = _read_file(Path(config_file)) if config_file else {}
    url = (
        database_url
        or os.environ.get("BATCHYARD_DATABASE_URL")
        or data.get("database_url")
        or f"sqlite:///{home / 'batchyard.db'}"
    )
    threshold = data.get("billing_review_threshold")
    settings = Settings(
        database_url=normalise_database_url(str(url)),
        home=home,
        catalog=catalog_from_config(data),
        tiers=tiers_from_config(data.get("tiers")),
        limiter_url=os.environ.get("BATCHYARD_LIMITER_URL") or data.get("limiter_url"),
        billing_review_threshold=Decimal(str(threshold)) if threshold is not None else None,
        batch_encryption_key=(
            os.environ.get("BATCHYARD_BATCH_ENCRYPTION_KEY") or data.get("batch_encryption_key")
        ),
        price_feed=os.environ.get("BATCHYARD_PRICE_FEED") or data.get("price_feed"),
        price_feed_interval_s=float(data.get("price_feed_interval_s", 60.0)),
        price_max_age_s=float(data.get("price_max_age_s", 300.0)),
        market_policy=str(data.get("market_policy", "first_eligible")),
        market_interval_s=float(data.get("market_interval_s", 15.0)),
        market_lease_s=float(data.get("market_lease_s", 120.0)),
        embedded_model_path=os.environ.get("BATCHYARD_MODEL_PATH")
        or data.get("embedded_model_path"),
        **_embedded(data, str(config_file or "the config")),
        shutdown_grace_s=float(
            os.environ.get("BATCHYARD_SHUTDOWN_GRACE_S") or data.get("shutdown_grace_s", 30.0)
        ),
        limits_queue_s=float(data.get("limits_queue_s", 10.0)),
        slot_lease_s=float(data.get("slot_lease_s", 60.0)),
        metrics_token=os.environ.get("BATCHYARD_METRICS_TOKEN") or data.get("metrics_token"),
        raw=data,
    )
    if "embedded_contexts" in overrides and "embedded_slots" not in overrides:
        overrides["embedded_slots"] = overrides["embedded_contexts"]
    elif "embedded_slots" in overrides:
        overrides["embedded_contexts"] = overrides["embedded_slots"]
    return replace(settings, **overrides) if overrides else settings
