"""Leases with fencing tokens: who holds a piece of work, and which claim of it.

A worker takes a run, a file batch's line or a deferred item under a lease
that expires unless renewed. An owner's name alone cannot tell a worker's
current claim from one it lost: a worker paused past its lease (a long GC, a
SIGSTOP, a VM migration) and resumed still carries its own name. So each
claim also adds one to the object's ``lease_token`` and hands the new value
to the claimant, and every write the holder makes (results, charges, state,
renewals) is conditioned on the token it was given. A stale token matches no
row: the write changes nothing and the worker learns it lost the work.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lease"]


@dataclass(frozen=True, slots=True)
class Lease:
    """One claim of a leased object: its holder and the fencing token of that claim."""

    owner: str
    token: int
