"""An organisation's webhook endpoints: registered, listed, shown, deleted, their secret rotated.

An endpoint is checked before anything is written; by default its target must be a
public address (``core.webhook_rules.address_allowed``: SSRF), plus the networks the
operator allows, and the host is resolved again at every delivery since DNS can change.
The secret is shown once, in the answer that made it; the store keeps it sealed.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.sections import WebhookSettings
from batchyard.core.webhook_rules import address_allowed, new_secret, parse_target
from batchyard.errors import Conflict, InvalidRequest, NotFound
from batchyard.service.deployment import Service
from batchyard.store import webhook_deliveries, webhook_endpoints
from batchyard.store.webhook_endpoints import Endpoint

__all__ = [
    "create",
    "delete",
    "endpoint_view",
    "get",
    "list_page",
    "rotate",
]

#: The most endpoints one organisation may have.
MAX_ENDPOINTS = 20


def endpoint_view(e: Endpoint, secret: str | None = None) -> dict[str, Any]:
    """The endpoint as the API shows it; ``secret`` only in the answer that made it."""
    view: dict[str, Any] = {
        "id": e.id,
        "object": "webhook_endpoint",
        "url": e.url,
        "description": e.description,
        "events": list(e.events),
        "created_at": isoformat(e.created_at),
        "updated_at": isoformat(e.updated_at),
    }
    if secret is not None:
        view["secret"] = secret
    return view


async def check_url(url: Any, settings: WebhookSettings) -> str:
    """A URL deliveries may go to: ``400 invalid_webhook_url`` for one that is not, ``403
    webhook_target_not_allowed`` for one the operator's networks forbid.

    A host that does not resolve (yet) is taken: DNS fails for a while, or a receiver's
    name is set up after its endpoint, and each delivery resolves the host again and
    checks every address it finds before it connects (``work.webhook_sender``)."""
    try:
        target = parse_target(url)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="url", code="invalid_webhook_url") from None
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except UnicodeError:  # a host no IDNA encoding can name
        raise InvalidRequest(
            f"the host {target.host!r} cannot be named in DNS",
            param="url",
            code="invalid_webhook_url",
        ) from None
    except OSError:
        infos = []
    for address in sorted({str(info[4][0]) for info in infos}):
        if not address_allowed(address, settings.allowed_networks):
            raise InvalidRequest(
                f"the url's host {target.host!r} is (or resolves to) {address}, a private, "
                "loopback, link-local or reserved address; webhooks go to public addresses "
                "unless the operator allows the network (webhooks.allowed_networks)",
                param="url",
                code="webhook_target_not_allowed",
                status=403,
            )
    return target.url


async def create(
    svc: Service, principal: Principal, url: str, events: Sequence[str], description: str | None
) -> dict[str, Any]:
    """Register an endpoint; its view with the secret, shown this once.

    ``events`` and ``description`` are the checked body's (``api.bodies.WebhookEndpointBody``:
    known event names, a short text); what only a resolver can say about the URL is checked
    here, where it is checked again at every delivery.
    """
    checked = list(dict.fromkeys(events))  # each once, in the order given
    url = await check_url(url, svc.webhooks.settings)
    secret = new_secret()
    now = svc.clock.now()

    def tx(c: Connection) -> Endpoint:
        org = principal.org_id
        live = webhook_endpoints.list_endpoints(c, org, after=None, limit=MAX_ENDPOINTS)
        if len(live) >= MAX_ENDPOINTS:
            raise Conflict(  # the organisation's state, not the body, stands in the way
                f"an organisation has at most {MAX_ENDPOINTS} webhook endpoints; delete one",
                code="too_many_webhook_endpoints",
            )
        return webhook_endpoints.create_endpoint(
            c, principal.org_id, url, checked, description, secret, now
        )

    endpoint = await svc.db.transact(tx)
    return endpoint_view(endpoint, secret)


def _missing(endpoint_id: str) -> NotFound:
    return NotFound(f"webhook endpoint {endpoint_id} not found", param="endpoint_id")


async def get(svc: Service, principal: Principal, endpoint_id: str) -> dict[str, Any]:
    found = await svc.db.read(
        lambda c: webhook_endpoints.get_endpoint(c, principal.org_id, endpoint_id)
    )
    if found is None:
        raise _missing(endpoint_id)
    return endpoint_view(found)


async def list_page(
    svc: Service, principal: Principal, *, after: str | None, limit: int
) -> dict[str, Any]:
    """Oldest first; ``after`` is the last id of the previous page."""
    org = principal.org_id
    rows = await svc.db.read(
        lambda c: webhook_endpoints.list_endpoints(c, org, after=after, limit=limit + 1)
    )
    more = len(rows) > limit
    data = [endpoint_view(e) for e in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "has_more": more,
        "last_id": data[-1]["id"] if data else None,
    }


async def delete(svc: Service, principal: Principal, endpoint_id: str) -> dict[str, Any]:
    """Delete an endpoint: no new events, and its waiting deliveries are given up."""
    now = svc.clock.now()

    def tx(c: Connection) -> bool:
        if not webhook_endpoints.delete_endpoint(c, principal.org_id, endpoint_id, now):
            return False
        webhook_deliveries.give_up_endpoint(c, endpoint_id, now)
        return True

    if not await svc.db.transact(tx):
        raise _missing(endpoint_id)
    return {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}


async def rotate(svc: Service, principal: Principal, endpoint_id: str) -> dict[str, Any]:
    """A new secret (shown this once); the old one signs nothing from now on."""
    secret = new_secret()
    now = svc.clock.now()
    found = await svc.db.transact(
        lambda c: webhook_endpoints.rotate_secret(c, principal.org_id, endpoint_id, secret, now)
    )
    if found is None:
        raise _missing(endpoint_id)
    return endpoint_view(found, secret)
