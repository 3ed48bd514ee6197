"""A lease queue in memory: the runner's ``LeaseQueue`` with no tables behind it.

What the runner's own tests drive (``tests/unit/work/test_runner.py``), and
the smallest complete example of the interface a new kind of leased work
implements (``batchyard.work.runner.LeaseQueue``): units wait, are claimed
under a lease (owner and a fencing token that grows with each claim), are
marked sent, recorded, handed back, or let go. Every write checks the
caller's lease, as the store's do (``batchyard.store.leases``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from batchyard.core.leases import Lease
from batchyard.errors import StorageUnavailable
from batchyard.work.runner import Claim, Recovered, Renewal

__all__ = ["MemoryQueue", "Unit"]


@dataclass
class Unit:
    """One unit of work: its state and its current lease, as a row would hold them."""

    key: int
    state: str = "waiting"  # waiting | claimed | done | uncertain
    owner: str | None = None
    token: int = 0
    expires: datetime | None = None
    sent: bool = False
    result: Any = None
    #: How many times a result was written (at most once, whatever happens).
    written: int = 0
    #: How many times a claim took it.
    claims: int = 0


@dataclass
class MemoryQueue:
    """``LeaseQueue[int, int, tuple[int, object]]``: a unit is its key; a result, (key, value)."""

    owner: str
    units: dict[int, Unit] = field(default_factory=dict)
    kind: str = "memory"
    #: What ``renew`` answers (a test stops the queue or takes it away).
    renewal: Renewal = Renewal.GOING
    #: ``mark_sent`` raises StorageUnavailable this many more times.
    mark_outages: int = 0
    #: Every call, for assertions: (method, keys).
    log: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    @classmethod
    def of(cls, n: int, owner: str = "wkr.a") -> MemoryQueue:
        return cls(owner=owner, units={k: Unit(k) for k in range(1, n + 1)})

    def state(self, key: int) -> str:
        return self.units[key].state

    def _ours(self, key: int, lease: Lease) -> Unit | None:
        unit = self.units.get(key)
        if unit is None or (unit.owner, unit.token) != (lease.owner, lease.token):
            return None
        return unit

    def claim(self, conn: Any, want: int, now: datetime, until: datetime) -> list[Claim[int, int]]:
        taken = [
            u for u in sorted(self.units.values(), key=lambda u: u.key) if u.state == "waiting"
        ]
        out = []
        for unit in taken[:want]:
            unit.state, unit.owner, unit.expires, unit.sent = "claimed", self.owner, until, False
            unit.token += 1
            unit.claims += 1
            out.append(Claim(unit.key, Lease(self.owner, unit.token), unit.key))
        self.log.append(("claim", tuple(c.key for c in out)))
        return out

    def renew(
        self, conn: Any, held: Mapping[int, Lease], now: datetime, until: datetime
    ) -> Renewal:
        if self.renewal is not Renewal.LOST:
            for key, lease in held.items():
                if (unit := self._ours(key, lease)) is not None and unit.state == "claimed":
                    unit.expires = until
        return self.renewal

    def record(
        self,
        conn: Any,
        held: Mapping[int, Lease],
        results: Sequence[tuple[int, object]],
        now: datetime,
    ) -> int:
        written = 0
        for key, value in results:
            unit = self._ours(key, held[key]) if key in held else None
            if unit is not None and unit.state == "claimed":
                unit.state, unit.result, unit.owner, unit.expires = "done", value, None, None
                unit.written += 1
                written += 1
        self.log.append(("record", tuple(k for k, _ in results)))
        return written

    def mark_sent(self, conn: Any, held: Mapping[int, Lease], now: datetime) -> set[int]:
        if self.mark_outages:
            self.mark_outages -= 1
            raise StorageUnavailable("the store is out for a moment")
        marked = set()
        for key, lease in held.items():
            if (unit := self._ours(key, lease)) is not None and unit.state == "claimed":
                unit.sent = True
                marked.add(key)
        return marked

    def requeue(self, conn: Any, held: Mapping[int, Lease], now: datetime) -> int:
        back = 0
        for key, lease in held.items():
            unit = self._ours(key, lease)
            if unit is not None and unit.state == "claimed":
                unit.state, unit.owner, unit.expires, unit.sent = "waiting", None, None, False
                back += 1
        self.log.append(("requeue", tuple(held)))
        return back

    def let_go(self, conn: Any, held: Mapping[int, Lease] | None, now: datetime) -> Recovered:
        if held is None:
            found = [
                u
                for u in self.units.values()
                if u.state == "claimed" and u.expires is not None and u.expires < now
            ]
        else:
            found = [u for k, lease in held.items() if (u := self._ours(k, lease)) is not None]
            found = [u for u in found if u.state == "claimed"]
        uncertain = returned = 0
        for unit in found:
            if unit.sent:
                unit.state = "uncertain"
                uncertain += 1
            else:
                unit.state = "waiting"
                returned += 1
            unit.owner = unit.expires = None
        self.log.append(("let_go", tuple(u.key for u in found)))
        return Recovered(leases=len(found), uncertain=uncertain, returned=returned)

    def lapsed(self, conn: Any, now: datetime) -> bool:
        return any(
            u.state == "claimed" and u.expires is not None and u.expires < now
            for u in self.units.values()
        )
