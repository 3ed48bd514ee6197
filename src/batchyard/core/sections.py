"""The config file's sections: each part's settings, declared once with their limits and docs.

Each is a frozen pydantic dataclass: the part's defaults, the check of its section (a
``ConfigError`` naming the field) and, through each field's ``description``, its row in
docs/reference/configuration.md.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from datetime import timedelta
from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from batchyard.core.config_errors import ConfigError

__all__ = [
    "SECTION",
    "FileBatchSettings",
    "FileSettings",
    "Network",
    "RunSettings",
    "Seconds",
    "VersionSettings",
    "WebhookSettings",
    "parse_networks",
    "setting",
]

#: How every section (and the settings themselves) are checked: unknown names refused.
SECTION = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def setting(
    default: Any,
    accepts: str = "",
    *,
    kind: str | None = None,
    shown: str | None = None,
    env: str | None = None,
    flag: str | None = None,
    **field: Any,
) -> Any:
    """One setting's field: its default, and what the reference page says of it.

    ``accepts`` is the page's "accepted values" text after the bounds the field
    declares (``> 0``); ``kind`` the type shown when the annotation says too
    little (``integer (tokens)``); ``shown`` the default when its value says too
    little (``86400 (24 h)``); ``env`` the environment variable when it is not
    ``BATCHYARD_<NAME>``; ``flag`` the command-line option that also sets it.
    """
    pairs = (("kind", kind), ("shown", shown), ("env", env), ("flag", flag))
    extra: dict[str, Any] = {k: v for k, v in pairs if v is not None}
    return Field(default, description=accepts or None, json_schema_extra=extra or None, **field)


#: A duration in seconds, above zero (the settings' and the sections' one kind).
Seconds = Annotated[float, Field(gt=0)]
_Count = Annotated[int, Field(ge=1)]


@dataclass(frozen=True, config=SECTION)
class RunSettings:
    """``runs:``: timings of batch inference runs.

    ``failure_streak`` failed rows in a row mean the route is broken, not the rows, so the
    run fails instead of burning through every row.
    """

    quote_ttl_s: Seconds = setting(
        86400.0, "how long a run's quote may be confirmed", shown="86400 (24 h)"
    )
    lease_s: Seconds = setting(60.0, "how long a silent worker keeps its runs")
    heartbeat_s: Seconds = setting(5.0, "how often a worker renews its lease")
    poll_s: Seconds = setting(0.5, "how often an idle worker looks for runs")
    flush_s: Seconds = setting(0.25, "finished rows are committed at least this often")
    concurrency: _Count = setting(32, "calls in flight per run when its route names none")
    max_active_runs: _Count = setting(2, "runs one worker executes at once")
    prepare_batch: _Count = setting(2000, "rows counted and quoted per transaction")
    write_batch: _Count = setting(500, "answered rows written per transaction")
    failure_streak: _Count = setting(50, "consecutive failed rows that fail the run")

    @property
    def quote_ttl(self) -> timedelta:
        return timedelta(seconds=self.quote_ttl_s)


@dataclass(frozen=True, config=SECTION)
class FileBatchSettings:
    """``file_batches:``: timings and widths of the file-batch worker."""

    poll_s: Seconds = setting(0.5, "seconds between idle rounds")
    lease_s: Seconds = setting(
        60.0, "how long a worker may go silent before its in-flight lines become uncertain"
    )
    flush_s: Seconds = setting(
        0.25, "finished lines are committed this often (or when half the slots are free)"
    )
    concurrency: _Count = setting(32, "calls in flight per batch when its route names none")
    max_active: _Count = setting(2, "batches one worker executes at once")
    end_chunk: _Count = setting(1000, "lines ended (expired, canceled, uncertain) per transaction")


@dataclass(frozen=True, config=SECTION)
class FileSettings:
    """``files:``: upload limits of ``POST /v1/files`` (OpenAI's by default)."""

    max_bytes: _Count = setting(200 * 1024 * 1024, "a file's size", shown="209715200 (200 MB)")
    max_lines: _Count = setting(50_000, "requests in one file")
    max_line_bytes: _Count = setting(1024 * 1024, "one line's size", shown="1048576 (1 MiB)")
    max_custom_id: _Count = setting(512, "characters of a line's `custom_id`")


#: How long a version stays loaded after its last request, unless kept warm.
IDLE_S = 15 * 60.0


@dataclass(frozen=True, config=SECTION)
class VersionSettings:
    """``model_versions:``: model versions uploaded into projects."""

    max_lora_bytes: _Count = setting(
        256 * 1024 * 1024,
        "a larger LoRA upload is refused (`413 file_too_large`)",
        shown="268435456 (256 MiB)",
    )
    max_weights_bytes: _Count = setting(
        8 * 1024 * 1024 * 1024, "the same for full weights", shown="8589934592 (8 GiB)"
    )
    folder: str | None = setting(
        None,
        "where accepted files are kept; every process of a deployment must see the same folder",
        kind="text (path)",
        shown="`$BATCHYARD_HOME/model-versions`",
    )
    idle_s: Seconds = setting(
        IDLE_S,
        "a version not used for this long (and not kept warm) is unloaded; its next request "
        "loads it again (decide falls back to the base after `warm_fallback_after_s`)",
        shown="900 (15 min)",
    )
    memory_budget_bytes: _Count | None = setting(
        None,
        "the memory the loaded versions of one process may hold together (an adapter: its "
        "file's size; full weights: their tensors, their own KV cache and the shelf their "
        "scheduler may fill, `embedded_shelf_mb`). Loading one past it first unloads the least "
        "recently used idle versions; when every loaded version is in use or kept warm, the "
        "request is refused with `503 model_memory_full` (retryable)",
        shown="none (no budget)",
    )

    @property
    def max_bytes(self) -> int:
        return max(self.max_lora_bytes, self.max_weights_bytes)

    def limit(self, kind: str) -> int:
        return self.max_lora_bytes if kind == "lora" else self.max_weights_bytes


def parse_networks(values: Iterable[Any]) -> tuple[Network, ...]:
    """CIDR blocks from configuration; a ``ValueError`` that names the bad one."""
    found: list[Network] = []
    for value in values:
        if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
            found.append(value)
            continue
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a CIDR block such as 10.0.0.0/8")
        try:
            found.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not a CIDR block such as 10.0.0.0/8") from None
    return tuple(found)


@dataclass(frozen=True, config=SECTION)
class WebhookSettings:
    """``webhooks:``: where deliveries may go and how they are retried."""

    allowed_networks: tuple[Network, ...] = setting(
        (),
        'networks a webhook URL may reach besides public addresses, e.g. `["10.20.0.0/16"]` '
        'for receivers inside your network, `["127.0.0.0/8"]` for one on the same machine. '
        "Without it, a URL whose host is or resolves to a loopback, private (10/8, 172.16/12, "
        "192.168/16, fc00::/7), link-local (169.254/16, the cloud metadata service), shared, "
        "multicast or reserved address is refused at registration "
        "(`403 webhook_target_not_allowed`) and at each delivery (the host is resolved again)",
        kind="list of CIDR blocks",
        shown="none",
    )
    timeout_s: Seconds = setting(10.0, "one attempt's limit (connect, send, answer)")
    max_attempts: _Count = setting(10, "attempts before a delivery is `failed`")
    base_delay_s: Seconds = setting(5.0, "the first retry's delay; each next one is 4× longer")
    max_delay_s: Seconds = setting(
        6 * 3600.0, "the longest delay between attempts", shown="21600 (6 h)"
    )
    jitter: Annotated[float, Field(ge=0, lt=1)] = setting(
        0.2, "each delay is spread by ± this much", kind="fraction"
    )
    concurrency: _Count = setting(16, "deliveries in flight at once per process")
    lease_s: Seconds = setting(
        60.0, "how long a silent worker keeps its deliveries before another retries them"
    )
    poll_s: Seconds = setting(1.0, "how often an idle sender looks for due deliveries")
    flush_s: Seconds = setting(0.25, "finished attempts are recorded at least this often")

    @field_validator("allowed_networks", mode="before")
    @classmethod
    def _networks(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str) or not isinstance(value, Iterable):
            return value  # the type's own error: expected a list
        try:
            return parse_networks(value)
        except ValueError as exc:
            raise ConfigError(
                "", str(exc), "give CIDR blocks such as 10.0.0.0/8 or 127.0.0.0/8"
            ) from None
