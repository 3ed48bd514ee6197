"""Prefixed UUIDv7 IDs: the wire's shape, sortable by creation time."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

from batchyard.core.clock import ManualClock
from batchyard.core.ids import ID_PATTERN, is_id, new_id, uuid7

# The runs API's project ID pattern (docs/reference/runs.md).
SEED_PP = re.compile(r"^pp\.[0-9a-f]{8}-[0-9a-f]{4}-[7][0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def test_new_ids_match_the_seed_pattern():
    clock = ManualClock()
    for _ in range(200):
        assert SEED_PP.match(new_id("pp", clock.now()))
    for prefix in ("ds", "bir", "res", "org"):
        value = new_id(prefix, clock.now())
        assert is_id(value, prefix)
        assert not is_id(value, "pp")
        assert ID_PATTERN.match(value).group("prefix") == prefix


def test_uuid7_carries_version_7_variant_and_the_millisecond():
    clock = ManualClock()
    u = uuid7(clock.now())
    assert u.version == 7
    assert u.variant == uuid.RFC_4122
    assert u.int >> 80 == int(clock.now().timestamp() * 1000)


def test_ids_sort_by_creation_time():
    clock = ManualClock()
    ids = []
    for _ in range(100):
        ids.append(new_id("act", clock.now()))
        clock.advance(0.001)
    assert ids == sorted(ids)
    later = new_id("act", clock.now() + timedelta(days=400))
    assert later > ids[-1]


def test_ids_made_in_the_same_millisecond_are_distinct():
    clock = ManualClock()
    ids = {new_id("x", clock.now()) for _ in range(1000)}
    assert len(ids) == 1000


def test_is_id_refuses_other_shapes():
    assert not is_id("pp.not-a-uuid", "pp")
    assert not is_id("pp." + str(uuid.uuid4()), "pp")  # version 4
    assert not is_id("PP." + str(uuid7(ManualClock().now())), "pp")
