"""The market history the worker saves: upserted per bin, pruned by age, loaded in order."""

from __future__ import annotations

from batchyard.store.market_history import load_history, save_history


def test_save_load_overwrite_and_prune(db):
    db.transact_sync(lambda c: save_history(c, {"a,b": [(10, 40.0), (11, None)], "c": [(10, 5.0)]}))
    assert db.transact_sync(lambda c: load_history(c, 0)) == {
        "a,b": [(10, 40.0), (11, None)],
        "c": [(10, 5.0)],
    }
    # The last bin of a pass may still change: saving it again overwrites it.
    db.transact_sync(lambda c: save_history(c, {"a,b": [(11, 55.5), (12, 60.0)]}, keep_from=11))
    assert db.transact_sync(lambda c: load_history(c, 0)) == {"a,b": [(11, 55.5), (12, 60.0)]}
    assert db.transact_sync(lambda c: load_history(c, 12)) == {"a,b": [(12, 60.0)]}
    assert db.transact_sync(lambda c: save_history(c, {})) == 0
