"""What a user hands the runner: texts, decisions and labels, checked before any send.

Everything the server would refuse for every text alike (a decision with one
outcome, an empty text, a duplicate id) is caught here, with one message that
names the problem, so a bad file costs nothing and sends nothing.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batchyard.client.types import Decision, Outcome

__all__ = [
    "InputError",
    "LabelledText",
    "TextItem",
    "load_decisions",
    "read_labels",
    "read_texts",
    "validate_decisions",
]

_SHOW = 5  # how many offending ids a message names


class InputError(ValueError):
    """A problem with the user's files, found before anything was sent or charged."""


@dataclass(frozen=True)
class TextItem:
    id: str
    text: str


@dataclass(frozen=True)
class LabelledText:
    id: str
    text: str
    labels: dict[str, str]


def _names(ids: Sequence[str]) -> str:
    shown = ", ".join(repr(i) for i in ids[:_SHOW])
    return shown + (f" and {len(ids) - _SHOW} more" if len(ids) > _SHOW else "")


# decisions -------------------------------------------------------------------


def load_decisions(path: str | Path) -> list[Decision]:
    """A YAML or JSON file holding a list of decisions, or ``{"decisions": [...]}``."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except OSError as exc:
        raise InputError(f"cannot read the decisions file {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise InputError(f"the decisions file {p} is not valid YAML or JSON: {exc}") from exc
    if isinstance(raw, dict) and "decisions" in raw:
        raw = raw["decisions"]
    try:
        return validate_decisions(raw)
    except InputError as exc:
        raise InputError(f"{p}: {exc}") from exc


def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def validate_decisions(raw: Any) -> list[Decision]:
    """The server's rules for a decision set, applied locally."""
    if not isinstance(raw, list) or not raw:
        raise InputError("no decisions: give a list with at least one decision")
    out: list[Decision] = []
    seen: set[str] = set()
    for n, item in enumerate(raw, 1):
        if not isinstance(item, dict):
            raise InputError(f"decision {n} is not a mapping")
        did = _text(item.get("id"))
        if did is None:
            raise InputError(f"decision {n} has no id")
        if did in seen:
            raise InputError(f"duplicate decision id {did!r}")
        seen.add(did)
        question = _text(item.get("question"))
        if question is None:
            raise InputError(f"decision {did!r} has an empty question")
        outcomes = item.get("outcomes")
        if not isinstance(outcomes, list) or len(outcomes) < 2:
            raise InputError(f"decision {did!r} needs at least two outcomes")
        out.append({"id": did, "question": question, "outcomes": _outcomes(did, outcomes)})
    return out


def _outcomes(did: str, raw: list[Any]) -> list[Outcome]:
    out: list[Outcome] = []
    seen: set[str] = set()
    for item in raw:
        raw_id = item.get("id") if isinstance(item, dict) else item
        if isinstance(raw_id, bool):
            raise InputError(
                f"decision {did!r} has the outcome {raw_id}: YAML reads yes/no as true/false, "
                "so quote them ('yes')"
            )
        oid = _text(raw_id)
        if oid is None:
            raise InputError(f"decision {did!r} has an outcome without an id")
        if oid in seen:
            raise InputError(f"decision {did!r} has the outcome {oid!r} twice")
        seen.add(oid)
        outcome: Outcome = {"id": oid}
        if isinstance(item, dict) and item.get("description") is not None:
            outcome["description"] = str(item["description"])
        out.append(outcome)
    return out


# texts -----------------------------------------------------------------------


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{path}:{n} is not valid JSON: {exc.msg}") from exc
            if not isinstance(row, dict):
                raise InputError(f"{path}:{n} is not a JSON object")
            yield row


def _csv_rows(path: Path, needed: Sequence[str]) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [f for f in needed if f not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path} has no column {_names(missing)}")
        yield from reader


def _parquet_rows(path: Path, needed: Sequence[str]) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise InputError("reading Parquet needs pyarrow: pip install 'batchyard[parquet]'") from exc
    schema = pq.read_schema(path)
    missing = [f for f in needed if f not in schema.names]
    if missing:
        raise InputError(f"{path} has no column {_names(missing)}")
    table = pq.read_table(path, columns=list(needed))
    yield from table.to_pylist()


def _rows(path: Path, needed: Sequence[str]) -> Iterator[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return _jsonl_rows(path)
    if suffix == ".csv":
        return _csv_rows(path, needed)
    if suffix in (".parquet", ".pq"):
        return _parquet_rows(path, needed)
    raise InputError(f"{path}: unknown format {suffix!r}; use .jsonl, .csv or .parquet")


def _id_of(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    return text or None


def read_texts(
    path: str | Path, *, id_field: str = "id", text_field: str = "text"
) -> list[TextItem]:
    """Every (id, text) of a JSONL, CSV or Parquet file, or one InputError for all problems."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no such file: {p}")
    items: list[TextItem] = []
    no_id: list[str] = []
    empty: list[str] = []
    for n, row in enumerate(_rows(p, (id_field, text_field)), 1):
        if id_field not in row:
            raise InputError(f"{p}: row {n} has no {id_field!r} field (use --id-field)")
        if text_field not in row:
            raise InputError(f"{p}: row {n} has no {text_field!r} field (use --text-field)")
        item_id = _id_of(row[id_field])
        if item_id is None:
            no_id.append(f"row {n}")
            continue
        text = row[text_field]
        if not isinstance(text, str) or not text.strip():
            empty.append(item_id)
            continue
        items.append(TextItem(item_id, text))
    if no_id:
        raise InputError(f"{p}: {len(no_id)} rows have an empty id: {', '.join(no_id[:_SHOW])}")
    if empty:
        raise InputError(f"{p}: {len(empty)} texts are empty: ids {_names(empty)}")
    dupes = [i for i, c in Counter(item.id for item in items).items() if c > 1]
    if dupes:
        raise InputError(f"{p}: {len(dupes)} ids appear more than once: {_names(dupes)}")
    if not items:
        raise InputError(f"{p} holds no texts")
    return items


def read_labels(path: str | Path, decisions: Sequence[Decision]) -> list[LabelledText]:
    """Lines ``{"id", "text", "labels": {decision: outcome}}``, checked against the decisions."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"no such file: {p}")
    outcomes = {d["id"]: {o["id"] for o in d["outcomes"]} for d in decisions}
    texts = {t.id: t.text for t in read_texts(p)}
    out: list[LabelledText] = []
    for n, row in enumerate(_jsonl_rows(p), 1):
        labels = row.get("labels")
        if not isinstance(labels, dict) or not labels:
            raise InputError(f"{p}:{n} has no labels")
        for did, oid in labels.items():
            if did not in outcomes:
                raise InputError(f"{p}:{n} labels the unknown decision {did!r}")
            if oid not in outcomes[did]:
                raise InputError(f"{p}:{n} labels {did!r} with the unknown outcome {oid!r}")
        item_id = _id_of(row.get("id"))
        assert item_id is not None  # read_texts checked every id
        out.append(
            LabelledText(item_id, texts[item_id], {str(k): str(v) for k, v in labels.items()})
        )
    return out
