"""``make demo`` (``batchyard demo``) shows what batchyard is for, and every answer reads well.

The demo is run as a newcomer runs it, a real process with the embedded model
on a throwaway server, and what it prints is read back: the quote before
anything runs, each comment's two answers with probabilities that add up, the
file batch's answers (each a different, non-empty reply), the charges and a
sound ledger. Nothing here is timed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from batchyard.cli.demo import COMMENTS, DECISIONS, PROMPTS

pytestmark = pytest.mark.model

BATCHYARD = str(Path(sys.executable).with_name("batchyard"))

#: What a reader expects of each comment; the demo's comments were chosen so the
#: embedded model agrees.
EXPECTED = {
    "c1": ("positive", "battery"),
    "c2": ("negative", "price"),
    "c3": ("positive", "delivery"),
    "c4": ("positive", "sound"),
    "c5": ("negative", "battery"),
}


def _money(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


@pytest.mark.timeout(1200)  # a few seconds on a quiet machine; minutes beside other work
def test_the_demo_shows_a_quote_decisions_a_batch_and_a_sound_ledger(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHYARD_")}
    env.update(COLUMNS="200", TMPDIR=str(tmp_path), NO_COLOR="1")
    out = subprocess.run(
        [BATCHYARD, "demo"], env=env, capture_output=True, text=True, timeout=1100, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stdout.splitlines()
    text = "\n".join(lines)
    steps = [s for s in ("1. A price", "2. Decide", "3. A batch", "4. What it cost") if s in text]
    assert len(steps) == 4, text

    # 1. The quote, before anything was charged.
    (quote,) = [ln for ln in lines if "nothing charged yet" in ln]
    assert _money(re.search(r"at most \$([\d.]+)", quote).group(1)) > 0

    # 2. One row a comment: its two answers, every outcome's probability, summing to 1.
    for comment_id, comment in COMMENTS:
        (row,) = [ln for ln in lines if comment in ln and "decide: " not in ln]
        found = re.findall(r"([a-z]+) (0\.\d\d|1\.00)", row)
        per_decision = [[(o, p) for o, p in found if o in _ids(d)] for d in DECISIONS]
        for decision, answers in zip(DECISIONS, per_decision, strict=True):
            assert {o for o, _ in answers} == _ids(decision), row
            assert abs(sum(float(p) for _, p in answers) - 1) <= 0.011, row
        chosen = tuple(answers[0][0] for answers in per_decision)  # most probable first
        assert chosen == EXPECTED[comment_id], (comment, row)

    # 3. The batch: each request answered, no two answers alike, none empty.
    assert "at most $" in text and "completed, 3/3 answered, 0 failed" in text
    table = text.split("3. A batch", 1)[1].split("4. What it cost", 1)[0]
    answers = [_answer_of(table, prompt) for _, prompt in PROMPTS]
    assert all(len(a.split()) >= 4 for a in answers), table
    assert len(set(answers)) == len(answers), answers

    # 4. Every charge listed, the credit left, and the audit's verdict.
    charges = [ln for ln in lines if "decide: " in ln or "the file batch, 3 chat" in ln]
    assert len(charges) == len(COMMENTS) + 1, charges  # each decide, and the batch once
    assert all(_money(re.findall(r"\$([\d.]+)", ln)[-1]) > 0 for ln in charges), charges
    assert "held $0" in text or "$0 held" in text, text
    assert "✓ ledger sound" in text.split("$ batchyard audit", 1)[1], text


def _ids(decision: dict) -> set[str]:
    return {o["id"] for o in decision["outcomes"]}


def _answer_of(table: str, prompt: str) -> str:
    """The answer beside ``prompt`` in a Rich table (its cells wrap over several lines)."""
    rows = re.split(r"\n[├└]", table)
    (row,) = [r for r in rows if prompt in r]  # a prompt fits its column in 200
    cells = [line.split("│")[2].strip() for line in row.splitlines() if line.count("│") >= 3]
    return " ".join(c for c in cells if c)
