"""Which embedding inputs share a decode: consecutive ones, under flash attention's tile."""

from __future__ import annotations

from batchyard.engines.llama.models import FA_TILE_ROWS, embedding_packs


def test_short_inputs_share_a_decode_while_their_rows_stay_under_the_tile() -> None:
    assert embedding_packs([20, 2, 28, 5, 30]) == [[0, 1, 2, 3], [4]]
    assert embedding_packs([32, 31]) == [[0, 1]]
    assert embedding_packs([32, 32]) == [[0], [1]]  # 64 rows would take the tiled kernel


def test_a_long_input_is_read_alone_and_order_is_kept() -> None:
    counts = [FA_TILE_ROWS, 3, 200, 4, 5]
    packs = embedding_packs(counts)
    assert packs == [[0], [1], [2], [3, 4]]
    assert [i for pack in packs for i in pack] == list(range(len(counts)))
    assert embedding_packs([]) == []
