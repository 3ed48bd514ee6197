"""examples/analyse_comments.py end to end on a slice: its own server, the real model."""

from __future__ import annotations

import importlib.util
import json
import sys
from decimal import Decimal
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "analyse_comments.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("analyse_comments", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_shipped_data_agree_with_each_other() -> None:
    ex = _example()
    decisions = ex.load_decisions(ex.DATA / "decisions.yaml")
    comments = {c.id: c.text for c in ex.read_texts(ex.DATA / "comments.jsonl")}
    labelled = ex.read_labels(ex.DATA / "comments_labels.jsonl", decisions)
    assert [d["id"] for d in decisions] == ["sentiment", "topic"]
    assert len(comments) == 40 and len(labelled) == 12
    # A labelled comment is the same text as in the post's comments, so the
    # check and the run send the same body under the same key: paid once.
    assert all(comments[t.id] == t.text for t in labelled)
    assert {t.labels["sentiment"] for t in labelled} == {"positive", "negative", "neutral"}


@pytest.mark.model
def test_estimate_check_run_and_summary_on_a_slice(tmp_path: Path) -> None:
    ex = _example()
    out = tmp_path / "answers.jsonl"
    analysis = ex.main(["--limit", "5", "--output", str(out)])

    decisions = ex.load_decisions(ex.DATA / "decisions.yaml")
    outcomes = {d["id"]: {o["id"] for o in d["outcomes"]} for d in decisions}
    assert analysis.estimate.texts == 5 and analysis.estimate.max_cost > 0
    assert analysis.run.failed == 0 and analysis.run.answered == 5
    [score] = analysis.check.models
    assert score.answered == 5 and score.failed == 0
    assert sum(score.labelled.values()) == 10  # 5 texts, 2 decisions each
    for decision, counts in analysis.counts.items():
        assert sum(counts.values()) == 5
        assert set(counts) <= outcomes[decision]

    # Paid once: the labelled comments the run also holds came back from the
    # check's saved answers, so the credit fell by the check plus the rest.
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    labelled_ids = {t["id"] for t in analysis.check.texts}
    run_only = sum((Decimal(r["charge"]) for r in rows if r["id"] not in labelled_ids), Decimal(0))
    assert analysis.credit_before - analysis.credit_after == score.cost + run_only
    assert analysis.spend == sum((Decimal(r["charge"]) for r in rows), Decimal(0))
