"""The webhook sender: the outbox's deliveries POSTed, signed, retried, on the one runner.

Deliveries are leased work like a batch's lines (``work.runner``'s four
things): the outbox table keeps the lease (``store.webhook_deliveries``),
``DeliveryQueue`` is its ``LeaseQueue``, ``WebhookSender.call`` makes one
attempt and ``render`` turns its outcome into the row's next state, and
``WebhookSender`` is the ``Runner`` the service starts with its other workers.

One attempt: the URL's host is resolved afresh and every address it names
must still be allowed (public, or inside ``webhooks.allowed_networks``: a
name that moved to 169.254.169.254 since it was registered is refused); the
delivery is marked sent, durably; then one POST of the stored payload, signed
the Standard Webhooks way (``core.webhook_rules.sign``), with a timeout and no
redirects (a 3xx is a failure like any non-2xx: following it would reach a
target nobody checked). A 2xx is delivered (the answer's body is never read);
anything else is retried after ``retry_delay`` of the clock until
``max_attempts``, then ``failed``. Each attempt is recorded in the
organisation's ``/v1/activity``.

The POST goes to the address that was checked, not to the name: the URL's host
is replaced by that address, the ``Host`` header and TLS's server name (and so
the certificate's check) keep the registered name. A name whose DNS answer
changes between the check and the connection (DNS rebinding) cannot move the
POST, and each attempt closes its connection, so no connection made for one
name carries another's delivery.

Where a model call is never sent twice (a lapsed line is ``uncertain``), a
delivery is: a worker that died mid-POST leaves a claim that lapses, and
recovery makes the delivery due again with the same ``webhook-id``. At least
once, with a stable id, is the contract; receivers dedupe on the id.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

import httpx
from sqlalchemy import Connection

from batchyard.core.clock import Clock
from batchyard.core.leases import Lease
from batchyard.core.sections import WebhookSettings
from batchyard.core.telemetry import Recorder
from batchyard.core.webhook_rules import (
    address_allowed,
    parse_target,
    retry_delay,
    sign,
)
from batchyard.errors import UpstreamError, UpstreamTimeout
from batchyard.store import webhook_deliveries as store
from batchyard.store.database import Database
from batchyard.work.dispatcher import OnSend
from batchyard.work.runner import Answered, Claim, Failed, Recovered, Renewal, Runner
from batchyard.work.runner import recover_lapsed as recover_claims

__all__ = ["DeliveryQueue", "WebhookSender"]

log = logging.getLogger("batchyard.webhooks")

USER_AGENT = "batchyard-webhooks/1"


class DeliveryQueue:
    """The outbox as the runner sees it (``LeaseQueue[str, Delivery, Attempted]``)."""

    kind = "webhooks"

    def __init__(self, owner: str = "") -> None:
        self.owner = owner

    def claim(
        self, conn: Connection, want: int, now: datetime, until: datetime
    ) -> list[Claim[str, store.Delivery]]:
        return [Claim(d.id, d.lease, d) for d in store.claim(conn, self.owner, want, now, until)]

    def renew(
        self, conn: Connection, held: Mapping[str, Lease], now: datetime, until: datetime
    ) -> Renewal:
        # Each delivery is its own unit: one lost claim is only that one's, never the step's.
        store.renew(conn, held, until)
        return Renewal.GOING

    def record(
        self,
        conn: Connection,
        held: Mapping[str, Lease],
        results: Sequence[store.Attempted],
        now: datetime,
    ) -> int:
        return store.record(conn, held, results, now)

    def mark_sent(self, conn: Connection, held: Mapping[str, Lease], now: datetime) -> set[str]:
        return store.mark_sent(conn, held, now)

    def requeue(self, conn: Connection, held: Mapping[str, Lease], now: datetime) -> int:
        return store.requeue(conn, held, now)

    def let_go(
        self, conn: Connection, held: Mapping[str, Lease] | None, now: datetime
    ) -> Recovered:
        # Never uncertain: an attempt cut off is sent again (at least once, same id).
        ended, _cut = store.let_go(conn, held, now)
        return Recovered(leases=ended, uncertain=0, returned=ended)

    def lapsed(self, conn: Connection, now: datetime) -> bool:
        return store.lapsed(conn, now)


def _refused(message: str) -> UpstreamError:
    """The URL's host resolves to an address deliveries may not reach (SSRF), or to none."""
    return UpstreamError(message, code="webhook_target_refused")


class WebhookSender(Runner):
    """One process's share of the outbox: due deliveries claimed, POSTed, recorded."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        metrics: Recorder,
        settings: WebhookSettings | None = None,
        owner: str | None = None,
        rand: random.Random | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings or WebhookSettings()
        super().__init__(name="webhooks", clock=clock, poll_s=self.settings.poll_s, owner=owner)
        self.db = db
        self.metrics = metrics
        self.rand = rand or random.Random()  # jitter, not a secret
        self.queue = DeliveryQueue(self.owner)
        self._transport = transport
        self.pipeline = self.new_pipeline(
            db, metrics, lease_s=self.settings.lease_s, flush_s=self.settings.flush_s
        )

    async def round(self) -> bool:
        """Recover lapsed claims (due again), then start sending while any delivery is due."""
        await self.recover()
        if self.draining or "deliveries" in self.active:
            return False
        now = self.clock.now()
        if await self.db.read(lambda c: store.due(c, now)):
            self.start("deliveries", self._deliver())
        return False

    async def recover(self) -> int:
        """Deliveries whose worker stopped renewing them: due again; how many."""
        recovered = await recover_claims(self.db, self.clock, self.metrics, self.queue)
        return recovered.returned

    async def _deliver(self) -> None:
        async with httpx.AsyncClient(
            timeout=self.settings.timeout_s,
            follow_redirects=False,
            trust_env=False,
            transport=self._transport,
            headers={"user-agent": USER_AGENT},
        ) as http:

            async def call(d: store.Delivery, on_send: OnSend) -> int:
                return await self.call(http, d, on_send)

            await self.pipeline.run(
                self.queue, width=self.settings.concurrency, call=call, render=self.render
            )

    async def _addresses(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return []
        return sorted({str(info[4][0]) for info in infos})

    async def call(self, http: httpx.AsyncClient, d: store.Delivery, on_send: OnSend) -> int:
        """One attempt: check where the host points now, mark sent, POST; the status code."""
        try:
            target = parse_target(d.url)
        except ValueError as exc:
            raise _refused(str(exc)) from None
        addresses = await self._addresses(target.host, target.port)
        if not addresses:
            raise _refused(f"the host {target.host} does not resolve")
        refused = [a for a in addresses if not address_allowed(a, self.settings.allowed_networks)]
        if refused:
            raise _refused(
                f"the host {target.host} resolves to {refused[0]}, which webhooks may not "
                "reach (webhooks.allowed_networks)"
            )
        timestamp = int(self.clock.now().timestamp())
        headers = {
            "content-type": "application/json",
            "webhook-id": d.id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(d.secret, d.id, timestamp, d.payload),
        }
        url = httpx.URL(d.url)
        # To the address checked, under the registered name (Host, TLS server name).
        headers["host"] = url.netloc.decode("ascii")
        headers["connection"] = "close"
        pinned = url.copy_with(host=addresses[0])
        extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
        await on_send()
        try:
            # Streamed, and the body never read: a receiver's answer is its status alone,
            # however much it sends.
            async with http.stream(
                "POST", pinned, content=d.payload, headers=headers, extensions=extensions
            ) as response:
                return response.status_code
        except httpx.TimeoutException:
            raise UpstreamTimeout(
                f"no answer within {self.settings.timeout_s:g} s", code="webhook_timeout"
            ) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(
                f"the receiver could not be reached ({type(exc).__name__})",
                code="webhook_unreachable",
            ) from None

    def render(self, d: store.Delivery, attempt: Answered[int] | Failed) -> store.Attempted:
        """The delivery's next state: delivered (2xx), due again later, or given up."""
        n = d.attempts + 1
        status: int | None = None
        if isinstance(attempt, Answered):
            status = attempt.value
            if 200 <= status < 300:
                return store.Attempted(
                    d.id, d.org_id, d.endpoint_id, d.event_type, n, True, status_code=status
                )
            error = f"the receiver answered {status}"
        else:
            error = f"{attempt.error.code}: {attempt.error.message}"
        retry_at: datetime | None = None
        if n < self.settings.max_attempts:
            delay = retry_delay(n, self.settings, self.rand)
            retry_at = self.clock.now() + timedelta(seconds=delay)
        else:
            log.warning(
                "webhook delivery given up",
                extra={"delivery_id": d.id, "endpoint_id": d.endpoint_id, "attempts": n},
            )
        return store.Attempted(
            d.id,
            d.org_id,
            d.endpoint_id,
            d.event_type,
            n,
            False,
            status_code=status,
            error=error[:500],
            retry_at=retry_at,
        )
