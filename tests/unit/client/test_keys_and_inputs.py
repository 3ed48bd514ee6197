"""Idempotency keys per text, and the local checks on texts and decisions."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchyard.client.inputs import InputError, load_decisions, read_labels, read_texts
from batchyard.client.keys import decision_set_hash, request_hash, resend_key, text_key
from tests.support.fake_gateway import DECISIONS, write_jsonl

# keys ------------------------------------------------------------------------


def test_key_is_id_plus_request_hash_and_changes_with_the_decisions() -> None:
    h = request_hash(DECISIONS, "kettei-core", 64)  # type: ignore[arg-type]
    assert text_key("c-1", h) == f"c-1-{h}"
    changed = copy.deepcopy(DECISIONS)
    changed[0]["question"] = "How does the writer feel, really?"
    assert request_hash(changed, "kettei-core", 64) != h  # type: ignore[arg-type]
    assert request_hash(DECISIONS, "kettei-fat", 64) != h  # type: ignore[arg-type]
    assert request_hash(DECISIONS, "kettei-core", 32) != h  # type: ignore[arg-type]
    assert decision_set_hash(changed) != decision_set_hash(DECISIONS)  # type: ignore[arg-type]
    assert text_key("c-1", h, "v2") == f"c-1-{h}-v2"


def test_long_or_odd_ids_are_hashed_to_fit() -> None:
    h = request_hash(DECISIONS, "kettei-core", 64)  # type: ignore[arg-type]
    long_key = text_key("x" * 500, h)
    spaced = text_key("an id with spaces é", h)
    for key in (long_key, spaced):
        assert len(key) <= 128 and all(0x21 <= ord(c) <= 0x7E for c in key)
    assert text_key("x" * 500, h) == long_key
    assert text_key("x" * 501, h) != long_key
    with pytest.raises(ValueError):
        text_key("a", h, "bad suffix")
    with pytest.raises(ValueError):
        text_key("a", h, "s" * 120)


def test_resend_key_counts_up() -> None:
    assert resend_key("c-1-abc") == "c-1-abc-rw1"
    assert resend_key("c-1-abc-rw1") == "c-1-abc-rw2"
    assert len(resend_key("k" * 126)) <= 128


# decisions -------------------------------------------------------------------


def test_decisions_load_from_yaml_list_or_json_mapping(tmp_path: Path) -> None:
    yml = tmp_path / "d.yaml"
    yml.write_text(
        "- id: spam\n  question: Is this spam?\n  outcomes:\n    - id: yes\n    - id: 'no'\n"
    )
    # YAML 1.1 reads a bare `yes` as true: quoting matters, and a bool is not an id.
    with pytest.raises(InputError, match="quote them"):
        load_decisions(yml)
    yml.write_text("- id: spam\n  question: Is this spam?\n  outcomes: ['y', 'n']\n")
    assert load_decisions(yml)[0]["outcomes"] == [{"id": "y"}, {"id": "n"}]
    js = tmp_path / "d.json"
    js.write_text(json.dumps({"decisions": DECISIONS}))
    assert load_decisions(js) == DECISIONS


@pytest.mark.parametrize(
    ("decisions", "message"),
    [
        ([], "at least one decision"),
        ([{"id": "a", "question": "q", "outcomes": [{"id": "x"}]}], "two outcomes"),
        ([{"id": "a", "question": " ", "outcomes": ["x", "y"]}], "empty question"),
        (
            [
                {"id": "a", "question": "q", "outcomes": ["x", "y"]},
                {"id": "a", "question": "q2", "outcomes": ["x", "y"]},
            ],
            "duplicate decision id",
        ),
        ([{"id": "a", "question": "q", "outcomes": ["x", "x"]}], "twice"),
        ([{"question": "q", "outcomes": ["x", "y"]}], "has no id"),
    ],
)
def test_decisions_the_server_would_refuse_are_refused_here(
    tmp_path: Path, decisions: list, message: str
) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(decisions))
    with pytest.raises(InputError, match=message):
        load_decisions(path)


# texts -----------------------------------------------------------------------

ROWS = [{"id": 1, "text": "first"}, {"id": "b", "text": "second"}]


def test_jsonl_csv_and_parquet_read_the_same(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "t.jsonl", ROWS)
    csv_path = tmp_path / "t.csv"
    csv_path.write_text('id,text\n1,first\nb,"second"\n')
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["1", "b"], "text": ["first", "second"]}), parquet)
    expected = [("1", "first"), ("b", "second")]
    for path in (jsonl, csv_path, parquet):
        assert [(t.id, t.text) for t in read_texts(path)] == expected


def test_field_names_are_configurable(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [{"cid": "a", "body": "x"}])
    items = read_texts(path, id_field="cid", text_field="body")
    assert items[0].id == "a"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"key": "a", "text": "x"}], "no 'id' field"),
        ([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}], "more than once"),
        ([{"id": "a", "text": "  "}, {"id": "b", "text": "y"}], "empty: ids 'a'"),
        ([{"id": "", "text": "x"}], "empty id"),
    ],
)
def test_bad_texts_stop_with_one_message(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(InputError, match=message):
        read_texts(write_jsonl(tmp_path / "t.jsonl", rows))


def test_missing_csv_and_parquet_columns_are_named(tmp_path: Path) -> None:
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("ident,text\n1,a\n")
    with pytest.raises(InputError, match="no column 'id'"):
        read_texts(csv_path)
    parquet = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["1"], "body": ["a"]}), parquet)
    with pytest.raises(InputError, match="no column 'text'"):
        read_texts(parquet)
    other = tmp_path / "t.xlsx"
    other.write_text("x")
    with pytest.raises(InputError, match="unknown format"):
        read_texts(other)


def test_labels_are_checked_against_the_decisions(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "l.jsonl", [{"id": "a", "text": "t", "labels": {"spam": "no"}}])
    assert read_labels(good, DECISIONS)[0].labels == {"spam": "no"}  # type: ignore[arg-type]
    bad = write_jsonl(tmp_path / "b.jsonl", [{"id": "a", "text": "t", "labels": {"spam": "maybe"}}])
    with pytest.raises(InputError, match="unknown outcome 'maybe'"):
        read_labels(bad, DECISIONS)  # type: ignore[arg-type]
