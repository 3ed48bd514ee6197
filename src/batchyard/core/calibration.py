"""Calibrated outcome probabilities: the model's bias over the outcomes, removed.

A small model asked to pick one of a few outcomes carries a prior over them
that has nothing to do with the text: it favours some label words, and the
outcome listed first. Yet its scores still rank the texts well: the
information is there, under a bias (docs/explanation/calibration.md has the
measurements). Two results from the literature remove most of it, and decide
uses both:

- *Contextual calibration* (Zhao et al., "Calibrate Before Use", ICML 2021):
  ask the model the same questions about texts that say nothing (``N/A``,
  ``[MASK]``, an empty text); what it answers then is its prior, and each
  answer's probabilities are divided by it.
- *Batch calibration* (Zhou et al., ICLR 2024): the mean of the model's
  probabilities over the texts of one batch estimates the same prior from the
  texts themselves. Decide keeps a running mean per decision set and uses only
  the texts answered before the one at hand, shrunk towards the content-free
  prior while few texts have been seen (``BATCH_PSEUDO_TEXTS``).

Position bias (the outcome listed first is favoured) is part of the same
prior: a decision set is its outcomes in the order listed, and the prior
estimated for that listing holds the pull of its first position, so dividing
it out removes both. A calibrated call therefore reads the one prompt an
uncalibrated call reads. A second, reversed listing averaged with the first,
and texts spread over two listings each with its own prior, were tried and
dropped (docs/explanation/calibration.md: what was tried, and what it scored).

Everything here is pure arithmetic on probability vectors, one per decision,
in the outcomes' listed order. The tuned constants were tuned on the tuning
halves of the sets in ``bench/decide_quality.py`` and are reported on the
held-out halves there.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BATCH_PSEUDO_TEXTS",
    "CONTENT_FREE_TEXTS",
    "CalibrationMode",
    "Prior",
    "blend_prior",
    "calibrate",
    "mean_probabilities",
    "set_fingerprint",
]

CalibrationMode = Literal["batch", "content_free", "none"]

# The content-free texts of Zhao et al.: a placeholder, a mask token, nothing.
CONTENT_FREE_TEXTS: tuple[str, ...] = ("N/A", "[MASK]", "")

# How many texts the content-free prior is worth against the running batch
# mean: with n texts seen, the prior is (c·content_free + Σ p) / (c + n).
# Tuned on the tuning halves (bench/decide_quality.py --tune): larger values
# make a set's first texts lean long on the content-free prior, which starves
# an outcome (docs/explanation/calibration.md has the figures).
BATCH_PSEUDO_TEXTS = 3.0

# Changing how candidates are scored changes what the stored estimates mean;
# it is part of the fingerprint, so old estimates are never reused. The prompt
# itself needs no version: its layout is part of the fingerprint (``layout``).
SCORING_VERSION = "decide-scoring-3"

# Probabilities are floored here before division and logarithms, so that an
# outcome the model all but rules out can't divide by zero.
_FLOOR = 1e-12


@dataclass(frozen=True, slots=True)
class Prior:
    """The model's estimated prior over each decision's outcomes, and how it was formed."""

    probabilities: list[list[float]]
    texts: list[int]


def set_fingerprint(
    model: str,
    decisions: Sequence[tuple[str, str, Sequence[tuple[str, str]]]],
    layout: str = "",
) -> str:
    """A stable name for one decision set on one model: what its estimates belong to.

    ``decisions`` are ``(id, question, [(outcome id, description), ...])``.
    Any change of wording, order or model is another set, with its own bias
    (the order included: the outcome listed first is favoured). ``layout`` is
    the prompt the set is asked in, with a placeholder for the text, and what is
    scored after it: the same questions laid out another way are another set
    too, so estimates made under one prompt layout never calibrate another.
    """
    canonical = json.dumps(
        [
            SCORING_VERSION,
            model,
            [[d, q, [list(o) for o in outs]] for d, q, outs in decisions],
            layout,
        ],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _normalise(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    if not total > 0.0 or not math.isfinite(total):
        return [1.0 / len(weights)] * len(weights)
    return [w / total for w in weights]


def mean_probabilities(samples: Sequence[Sequence[float]]) -> list[float]:
    """The arithmetic mean of several probability vectors (the content-free prior)."""
    if not samples:
        raise ValueError("no samples to average")
    n = len(samples[0])
    return _normalise([sum(s[j] for s in samples) / len(samples) for j in range(n)])


def blend_prior(
    content_free: Sequence[float],
    prob_sum: Sequence[float],
    texts: int,
    pseudo_texts: float = BATCH_PSEUDO_TEXTS,
) -> list[float]:
    """The prior from the content-free estimate and the batch so far.

    The running mean of the ``texts`` answers before this one, shrunk towards
    the content-free prior as if it were ``pseudo_texts`` more answers: the
    first text of a set is calibrated by the content-free prior alone, and the
    batch mean takes over as texts arrive.
    """
    if texts <= 0:
        return _normalise(list(content_free))
    return _normalise(
        [
            (pseudo_texts * c + s) / (pseudo_texts + texts)
            for c, s in zip(content_free, prob_sum, strict=True)
        ]
    )


def calibrate(raw: Sequence[float], prior: Sequence[float]) -> list[float]:
    """``raw`` with ``prior`` divided out and renormalised (Zhao et al.'s diagonal calibration)."""
    return _normalise([r / max(p, _FLOOR) for r, p in zip(raw, prior, strict=True)])
