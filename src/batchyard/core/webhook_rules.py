"""Webhooks' rules with no I/O: the events, the secret, the signature, the retries, the targets.

A webhook tells an organisation's own server that a batch ended, so it need
not poll. Deliveries follow Standard Webhooks (standardwebhooks.com), which
receivers verify with a stock library: three headers, ``webhook-id`` (the
delivery's stable id: a retry sends the same one, so a receiver dedupes on
it), ``webhook-timestamp`` (Unix seconds of this attempt) and
``webhook-signature`` (``v1,`` and the base64 HMAC-SHA256 of
``"{id}.{timestamp}.{body}"`` keyed with the base64-decoded secret after
``whsec_``).

A delivery is tried until the receiver answers 2xx, with exponential backoff
and jitter between tries (``retry_delay``), ``max_attempts`` times in all
(about a day with the defaults), then given up as ``failed``.

Targets are the gateway's own network seen from outside, so by default a URL
may only reach public addresses: loopback, private, link-local (the cloud
metadata service at 169.254.169.254), multicast and reserved ranges are
refused (SSRF), at registration and again at each delivery, where the host
is resolved afresh. An operator who runs receivers inside the network allows
them with ``webhooks.allowed_networks`` (CIDR blocks).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from batchyard.core.sections import Network, WebhookSettings

__all__ = [
    "BATCH_EVENTS",
    "EVENTS",
    "MESSAGE_BATCH_ENDED",
    "SECRET_PREFIX",
    "Target",
    "address_allowed",
    "event_for",
    "new_secret",
    "parse_target",
    "retry_delay",
    "sign",
]

#: OpenAI's events for a file batch, by the stored status that ends it.
BATCH_EVENTS: Mapping[str, str] = {
    "completed": "batch.completed",
    "failed": "batch.failed",
    "expired": "batch.expired",
    "canceled": "batch.cancelled",  # OpenAI's spelling on the wire
}
#: Our extension: a Message Batch's ``processing_status`` became ``ended``.
MESSAGE_BATCH_ENDED = "message_batch.ended"
#: Every event an endpoint may subscribe to.
EVENTS: tuple[str, ...] = (*BATCH_EVENTS.values(), MESSAGE_BATCH_ENDED)

SECRET_PREFIX = "whsec_"  # noqa: S105 (the format's prefix, not a secret)
_SECRET_BYTES = 32


def event_for(status: str, *, message_batch: bool) -> str | None:
    """The event a batch ending in ``status`` sends (None: the status ends nothing)."""
    if status not in BATCH_EVENTS:
        return None
    return MESSAGE_BATCH_ENDED if message_batch else BATCH_EVENTS[status]


def new_secret() -> str:
    """A signing secret as Standard Webhooks writes it: ``whsec_`` and base64 of 32 bytes."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(_SECRET_BYTES)).decode("ascii")


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header's value for one attempt: ``v1,<base64 HMAC-SHA256>``."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def retry_delay(attempts: int, settings: WebhookSettings, rand: random.Random) -> float:
    """Seconds before the next try, after ``attempts`` failed ones (1 or more).

    ``base_delay_s`` × 4^(attempts-1), capped at ``max_delay_s``, then spread by
    ±``jitter`` so that receivers coming back up are not hit by every sender at
    once. With the defaults: about 5 s, 20 s, 80 s, 5 min, 21 min, 85 min,
    then every 6 h: ten tries over about 20 h.
    """
    base = min(settings.max_delay_s, settings.base_delay_s * 4.0 ** max(0, attempts - 1))
    spread = settings.jitter
    return float(base * rand.uniform(1.0 - spread, 1.0 + spread))


def address_allowed(address: str, allowed: Sequence[Network]) -> bool:
    """Whether a delivery may connect to ``address``: public, or inside an allowed network."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1
    if any(ip in net for net in allowed):
        return True
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True, slots=True)
class Target:
    """A webhook URL taken apart: what a delivery connects to."""

    url: str
    scheme: str
    host: str
    port: int


def parse_target(url: str) -> Target:
    """An http(s) URL with a host; a ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(url, str) or not url or len(url) > 2048:
        raise ValueError("url must be an http:// or https:// URL of at most 2048 characters")
    if any(ord(c) <= 32 or ord(c) == 127 for c in url):
        raise ValueError("url must not hold spaces or control characters")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"url must be http:// or https://, not {parts.scheme or 'none'}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("url must not carry a user name or password")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("url has a port that is not a number from 0 to 65535") from None
    host = parts.hostname
    if not host:
        raise ValueError("url has no host")
    if parts.fragment:
        raise ValueError("url must not have a #fragment")
    return Target(url, scheme, host, port or (443 if scheme == "https" else 80))
