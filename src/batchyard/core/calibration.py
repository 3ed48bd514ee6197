"""Calibrated outcome probabilities: the model's bias over the outcomes, removed.

A small model asked to pick one of a few outcomes carries a prior over them
that has nothing to do with the text: it favours some label words, and the
outcome listed first. On human-rated tweets the embedded SmolLM2 picks
"positive" for 98% of them, yet its scores still rank positive texts above
negative ones well (AUC 0.9): the information is there, under a bias. Two
results from the literature remove most of it, and decide uses both:

- *Contextual calibration* (Zhao et al., "Calibrate Before Use", ICML 2021):
  ask the model the same questions about texts that say nothing (``N/A``,
  ``[MASK]``, an empty text); what it answers then is its prior, and each
  answer's probabilities are divided by it.
- *Batch calibration* (Zhou et al., ICLR 2024): the mean of the model's
  probabilities over the texts of one batch estimates the same prior from the
  texts themselves. Decide keeps a running mean per decision set and uses only
  the texts answered before the one at hand, shrunk towards the content-free
  prior while few texts have been seen (``BATCH_PSEUDO_TEXTS``).

Position bias (the outcome listed first is favoured) is a bias of the
listing: each call is scored under ONE listing of the outcomes, picked from
``LISTING_ORDERS`` by a hash of its input (``choose_order``), and each
listing has a prior of its own (its content-free estimate and its own
running mean), so the pull of the first position is divided out with the
rest of that listing's bias. A calibrated call reads one prompt, as an
uncalibrated one does; scoring every text under two listings and averaging
them doubled the model's work for no better answers on the tuning halves.

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
    "LISTING_ORDERS",
    "CalibrationMode",
    "Order",
    "Prior",
    "blend_prior",
    "calibrate",
    "choose_order",
    "listing",
    "mean_probabilities",
    "set_fingerprint",
]

CalibrationMode = Literal["batch", "content_free", "none"]

# How a call lists each decision's outcomes: as the caller gave them, or reversed.
Order = Literal["given", "reversed"]

# The content-free texts of Zhao et al.: a placeholder, a mask token, nothing.
CONTENT_FREE_TEXTS: tuple[str, ...] = ("N/A", "[MASK]", "")

# How many texts the content-free prior is worth against the running batch
# mean: with n texts seen, the prior is (c·content_free + Σ p) / (c + n).
# Tuned on the tuning halves (bench/decide_quality.py --tune): 3 to 30 scored
# within two points of each other; the content-free prior alone, 3-7 lower.
BATCH_PSEUDO_TEXTS = 10.0

# The listings calls are spread over, by a hash of each call's input. Each has
# its own prior. Tuned on the tuning halves (bench/decide_quality.py --tune).
LISTING_ORDERS: tuple[Order, ...] = ("given", "reversed")

# Changing the prompt or the scoring changes what the stored estimates mean;
# it is part of the fingerprint, so old estimates are never reused.
SCORING_VERSION = "decide-scoring-2"

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
    order: Order = "given",
) -> str:
    """A stable name for one decision set on one model, listed one way: what its estimates
    belong to.

    ``decisions`` are ``(id, question, [(outcome id, description), ...])`` as
    the caller gave them; ``order`` is how the prompt listed them. Any change
    of wording, order, listing or model is another set, with its own bias.
    """
    canonical = json.dumps(
        [
            SCORING_VERSION,
            model,
            order,
            [[d, q, [list(o) for o in outs]] for d, q, outs in decisions],
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


def choose_order(key: str, orders: Sequence[Order] = LISTING_ORDERS) -> Order:
    """The listing one call is scored under: picked by a hash of its input ``key``.

    The same text always gets the same listing, hence the same answer; over a
    batch the listings share the texts about evenly, and each learns its own
    running mean.
    """
    if not orders:
        raise ValueError("no listing orders to choose from")
    digest = hashlib.sha256(key.encode("utf-8", errors="surrogatepass")).digest()
    return orders[int.from_bytes(digest[:8], "big") % len(orders)]


def listing(order: Order, n: int) -> list[int]:
    """The positions, in the prompt, of ``n`` outcomes listed by ``order``."""
    return list(range(n)) if order == "given" else list(range(n - 1, -1, -1))


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
