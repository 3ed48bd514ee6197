"""The error tree: one code per class, one body shape, and a docstring that shows it all."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from batchyard import errors
from batchyard.errors import BatchyardError, error_class_for_code


def _classes() -> list[type[BatchyardError]]:
    found = [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BatchyardError) and obj.__module__ == errors.__name__
    ]
    return sorted(found, key=lambda c: c.__name__)


CLASSES = _classes()
# The base is abstract: its code is the fallback for an unknown one.
CONCRETE = [c for c in CLASSES if c is not BatchyardError]


def test_every_class_is_exported():
    assert {c.__name__ for c in CLASSES} <= set(errors.__all__)


def test_codes_are_unique_snake_case_wire_codes():
    codes = [c.code for c in CONCRETE]
    duplicates = {code for code in codes if codes.count(code) > 1}
    assert not duplicates, duplicates
    for cls in CONCRETE:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", cls.code), cls


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_status_and_retryable_are_sane(cls):
    assert 400 <= cls.status <= 599
    assert isinstance(cls.retryable, bool)
    # Client errors are the caller's to fix, except waiting out a limit or a busy
    # key, and buying credit (docs/reference/errors.md: "buy credit ... then send them again").
    if cls.status < 500 and cls.status != 429:
        expected = cls.code in ("idempotency_in_progress", "insufficient_credit")
        assert cls.retryable is expected, cls
    if cls.status == 429:
        assert cls.retryable


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_to_body_has_the_wire_shape(cls):
    plain = cls("something went wrong").to_body()
    assert plain == {
        "error": {
            "code": cls.code,
            "type": errors.error_type(cls.status),
            "message": "something went wrong",
            "retryable": cls.retryable,
        }
    }
    json.dumps(plain)
    full = cls(
        "over", param="messages", retry_after=2.5, details={"required": "0.1", "available": "0"}
    ).to_body()["error"]
    assert full == {
        "code": cls.code,
        "type": errors.error_type(cls.status),
        "message": "over",
        "retryable": cls.retryable,
        "param": "messages",
        "retry_after": 2.5,
        "required": "0.1",
        "available": "0",
    }


OPENAI_TYPES = {
    "invalid_request": "invalid_request_error",
    "invalid_api_key": "authentication_error",
    "insufficient_credit": "insufficient_quota",
    "insufficient_scope": "permission_error",
    "not_found": "not_found_error",
    "model_not_found": "not_found_error",
    "idempotency_conflict": "conflict_error",
    "request_too_large": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
    "rate_limited": "rate_limit_error",
    "internal_error": "api_error",
    "upstream_timeout": "api_error",
    "storage_unavailable": "api_error",
}


@pytest.mark.parametrize(("code", "expected"), sorted(OPENAI_TYPES.items()))
def test_each_error_carries_openais_type_for_its_status(code, expected):
    body = error_class_for_code(code)("x").to_body()["error"]
    assert body["type"] == expected


def test_the_type_follows_a_narrowed_status():
    gone = errors.NotFound("results deleted", code="results_expired", status=410)
    assert gone.to_body()["error"]["type"] == "not_found_error"
    busy = errors.UpstreamError("slow", status=503)
    assert busy.to_body()["error"]["type"] == "api_error"


def test_the_errors_reference_lists_each_type_and_the_routers_codes():
    text = DOCS.read_text(encoding="utf-8")
    for kind in set(OPENAI_TYPES.values()):
        assert f"`{kind}`" in text, kind
    assert "| `method_not_allowed` | 405 |" in text


def test_an_instance_can_narrow_code_status_and_retryable():
    exc = errors.InvalidRequest("x", code="samples_out_of_range")
    assert exc.to_body()["error"]["code"] == "samples_out_of_range"
    assert exc.status == 400
    up = errors.UpstreamError("no", code="upstream_rejected", status=502, retryable=False)
    assert (up.code, up.status, up.retryable) == ("upstream_rejected", 502, False)
    # The class keeps its own values.
    assert errors.UpstreamError.retryable is True
    assert errors.InvalidRequest.code == "invalid_request"
    assert "samples_out_of_range" in repr(exc)


@pytest.mark.parametrize("cls", CONCRETE, ids=lambda c: c.__name__)
def test_error_class_for_code_rebuilds_the_class(cls):
    rebuilt = error_class_for_code(cls.code)
    assert (rebuilt.code, rebuilt.status, rebuilt.retryable) == (
        cls.code,
        cls.status,
        cls.retryable,
    )


def test_an_unknown_code_rebuilds_the_base():
    assert error_class_for_code("no_such_code") is BatchyardError


def _tree() -> str:
    doc = errors.__doc__ or ""
    start = doc.index("BatchyardError\n")
    return doc[start:]


def test_the_docstring_tree_lists_every_class_under_its_parent():
    tree = _tree()
    lines = tree.splitlines()

    def first_line(name: str) -> int:
        for i, line in enumerate(lines):
            if re.search(rf"\b{name}\b", line):
                return i
        raise AssertionError(f"{name} is not in the docstring tree of batchyard.errors")

    for cls in CLASSES:
        row = first_line(cls.__name__)
        if cls is BatchyardError:
            continue
        parent = cls.__mro__[1]
        assert first_line(parent.__name__) <= row, f"{cls.__name__} is listed before {parent}"


DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "errors.md"


def _doc_rows() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `([a-z_]+)` \| (\w+) \| ([\w ]+?) \| `(\w+)` \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def test_the_errors_reference_lists_every_class_with_its_status_and_retryable():
    rows = _doc_rows()
    for cls in CONCRETE:
        assert cls.code in rows, f"docs/reference/errors.md lacks {cls.code}"
        assert rows[cls.code] == (
            str(cls.status),
            "yes" if cls.retryable else "no",
            cls.__name__,
        ), cls.code


def test_the_errors_reference_lists_every_code_narrowed_in_the_source():
    rows = _doc_rows()
    src = Path(errors.__file__).parent
    narrowed = {
        m.group(1)
        for path in src.rglob("*.py")
        for m in re.finditer(r'\bcode="([a-z_]+)"', path.read_text(encoding="utf-8"))
    }
    missing = sorted(narrowed - set(rows))
    assert not missing, f"docs/reference/errors.md lacks {missing}"


def test_a_code_narrowed_to_another_status_is_listed_with_that_status():
    # ``results_expired`` is a NotFound sent as 410: the reference must say 410, as the wire does.
    rows = _doc_rows()
    src = Path(errors.__file__).parent
    narrowed = {
        m.group(1): m.group(2)
        for path in src.rglob("*.py")
        for m in re.finditer(
            r'\bcode="([a-z_]+)",\s*(?:[a-z_]+=[^,()]+,\s*)*?status=(\d+)',
            path.read_text(encoding="utf-8"),
        )
    }
    assert "results_expired" in narrowed
    wrong = {c: (status, rows[c][0]) for c, status in narrowed.items() if rows[c][0] != status}
    assert not wrong, f"docs/reference/errors.md gives another status: {wrong}"
