"""What decide knows about a model's bias on one decision set, shared by every process.

Calibration (``batchyard.core.calibration``) divides each answer's raw
probabilities by the model's prior over the outcomes. Two estimates of that
prior are kept here, one row per organisation, decision set (its
fingerprint), decision and outcome:

- ``content_free``: the mean probability the model gives the outcome when the
  text says nothing (``N/A``, ``[MASK]``, an empty text). Estimated once per
  organisation and set, by the call that first needs it, which pays for it.
- ``prob_sum`` over ``texts``: the running sum of the raw probabilities of
  every text of this set answered so far, for the batch mean. It is kept as a
  sum and a count, so that several processes add to it with one
  ``UPDATE ... SET prob_sum = prob_sum + :p, texts = texts + :n`` each (the
  texts a process answered since its last write, written in the background)
  and never lose an update, on SQLite and PostgreSQL alike.

It is kept per organisation: one organisation's texts never move another's
answers, and nothing of a text is stored, only sums of probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Float,
    Integer,
    String,
    Table,
    bindparam,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from batchyard.store.tables import metadata

__all__ = ["SetState", "add_texts", "decide_calibration", "load_state", "save_content_free"]

decide_calibration = Table(
    "decide_calibration",
    metadata,
    Column("org_id", String(64), primary_key=True),
    Column("fingerprint", String(64), primary_key=True),
    Column("decision", Integer, primary_key=True),
    Column("outcome", Integer, primary_key=True),
    Column("content_free", Float, nullable=False),
    Column("texts", BigInteger, nullable=False),
    Column("prob_sum", Float, nullable=False),
)


@dataclass(frozen=True, slots=True)
class SetState:
    """One decision set's stored estimates, per decision then per outcome (in listed order)."""

    content_free: list[list[float]]
    texts: list[int]
    prob_sums: list[list[float]]


def load_state(conn: Connection, org_id: str, fingerprint: str) -> SetState | None:
    """The set's estimates, or ``None`` when its content-free prior is not known yet."""
    t = decide_calibration.c
    rows = conn.execute(
        select(t.decision, t.outcome, t.content_free, t.texts, t.prob_sum)
        .where(t.org_id == org_id, t.fingerprint == fingerprint)
        .order_by(t.decision, t.outcome)
    ).all()
    if not rows:
        return None
    content_free: list[list[float]] = []
    texts: list[int] = []
    sums: list[list[float]] = []
    for decision, outcome, cf, n, total in rows:
        if decision == len(content_free):
            content_free.append([])
            sums.append([])
            texts.append(int(n))
        if decision != len(content_free) - 1 or outcome != len(content_free[-1]):
            return None  # a partial set (never written so): estimate it again
        content_free[-1].append(float(cf))
        sums[-1].append(float(total))
    return SetState(content_free, texts, sums)


def save_content_free(
    conn: Connection, org_id: str, fingerprint: str, prior: Sequence[Sequence[float]]
) -> None:
    """Store the content-free prior; where another process stored one first, keep theirs."""
    rows = [
        {
            "org_id": org_id,
            "fingerprint": fingerprint,
            "decision": k,
            "outcome": j,
            "content_free": float(p),
            "texts": 0,
            "prob_sum": 0.0,
        }
        for k, probs in enumerate(prior)
        for j, p in enumerate(probs)
    ]
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    conn.execute(insert(decide_calibration).on_conflict_do_nothing(), rows)


_ADD = (
    update(decide_calibration)
    .where(
        decide_calibration.c.org_id == bindparam("o"),
        decide_calibration.c.fingerprint == bindparam("f"),
        decide_calibration.c.decision == bindparam("d"),
        decide_calibration.c.outcome == bindparam("j"),
    )
    .values(
        texts=decide_calibration.c.texts + bindparam("n"),
        prob_sum=decide_calibration.c.prob_sum + bindparam("p"),
    )
)


def add_texts(
    conn: Connection,
    org_id: str,
    fingerprint: str,
    probabilities: Sequence[Sequence[float]],
    *,
    texts: int = 1,
) -> None:
    """Fold ``texts`` texts into the running sums: ``probabilities`` is the sum of their raw
    probabilities (per decision, per outcome), one text's when ``texts`` is 1."""
    rows = [
        {"o": org_id, "f": fingerprint, "d": k, "j": j, "n": texts, "p": float(p)}
        for k, probs in enumerate(probabilities)
        for j, p in enumerate(probs)
    ]
    if rows:
        conn.execute(_ADD, rows)
