"""Migration 0007 adds decide's calibration state; its writes are safe from several processes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import inspect

from batchyard.store import migrations
from batchyard.store.calibration import add_texts, load_state, save_content_free


def test_0007_stores_priors_adds_texts_and_downgrades_cleanly(fresh_db):
    fresh_db.migrate()
    assert "decide_calibration" in inspect(fresh_db.engine).get_table_names()
    assert fresh_db.read_sync(lambda c: load_state(c, "org", "fp")) is None
    prior = [[0.7, 0.2, 0.1], [0.5, 0.5]]
    fresh_db.transact_sync(lambda c: save_content_free(c, "org", "fp", prior))
    # A second estimate (another process, a moment later) does not replace the first.
    fresh_db.transact_sync(
        lambda c: save_content_free(c, "org", "fp", [[0.1, 0.1, 0.8], [0.9, 0.1]])
    )
    fresh_db.transact_sync(lambda c: add_texts(c, "org", "fp", [[0.6, 0.3, 0.1], [0.2, 0.8]]))
    fresh_db.transact_sync(lambda c: add_texts(c, "org", "fp", [[0.2, 0.3, 0.5], [0.4, 0.6]]))
    state = fresh_db.read_sync(lambda c: load_state(c, "org", "fp"))
    assert state is not None
    assert state.content_free == prior
    assert state.texts == [2, 2]
    assert state.prob_sums[0] == pytest.approx([0.8, 0.6, 0.6])
    assert state.prob_sums[1] == pytest.approx([0.6, 1.4])
    # Per organisation: another one's texts never move these sums.
    assert fresh_db.read_sync(lambda c: load_state(c, "other", "fp")) is None
    migrations.downgrade(fresh_db.engine, "0006")
    assert "decide_calibration" not in inspect(fresh_db.engine).get_table_names()
    fresh_db.migrate()
    assert fresh_db.read_sync(lambda c: load_state(c, "org", "fp")) is None


def test_concurrent_texts_are_all_counted(fresh_db):
    fresh_db.migrate()
    fresh_db.transact_sync(lambda c: save_content_free(c, "org", "fp", [[0.5, 0.5]]))

    def one(_: int) -> None:
        fresh_db.transact_sync(lambda c: add_texts(c, "org", "fp", [[0.25, 0.75]]))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    state = fresh_db.read_sync(lambda c: load_state(c, "org", "fp"))
    assert state is not None and state.texts == [40]
    assert state.prob_sums[0] == pytest.approx([10.0, 30.0])
