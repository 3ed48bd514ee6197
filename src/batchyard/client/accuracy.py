"""How good a model's answers are against known labels: the numbers ``check`` reports.

Accuracy alone flatters a model that answers the commonest outcome every
time, so beside it: balanced accuracy (the mean of each outcome's recall,
where always answering one outcome of three scores 33%), the confusion
matrix (which outcome is mistaken for which), and the expected calibration
error (how far the stated probability of the chosen outcome is from how
often it is right, averaged over ten confidence bins). Each is computed for
the raw and the calibrated probabilities alike, so a user sees on their own
sample what calibration bought.

Pure functions, usable without a server (the bench imports them too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ECE_BINS",
    "Quality",
    "accuracy",
    "balanced_accuracy",
    "expected_calibration_error",
]

ECE_BINS = 10


def accuracy(matrix: Sequence[Sequence[int]]) -> float | None:
    """Share of answers equal to the label; ``None`` with nothing counted."""
    total = sum(sum(row) for row in matrix)
    return sum(matrix[i][i] for i in range(len(matrix))) / total if total else None


def balanced_accuracy(matrix: Sequence[Sequence[int]]) -> float | None:
    """The mean recall over the outcomes that occur as labels."""
    recalls = [row[i] / sum(row) for i, row in enumerate(matrix) if sum(row)]
    return sum(recalls) / len(recalls) if recalls else None


def expected_calibration_error(
    confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS
) -> float | None:
    """Mean gap between stated confidence and observed accuracy, over equal-width bins.

    Each answer falls in the bin of its chosen outcome's probability; a bin
    weighs by its share of the answers (Guo et al., 2017).
    """
    if not confidences:
        return None
    groups: dict[int, list[tuple[float, bool]]] = {}
    for p, ok in zip(confidences, correct, strict=True):
        groups.setdefault(min(int(p * bins), bins - 1), []).append((p, ok))
    n = len(confidences)
    return sum(
        abs(sum(p for p, _ in g) / len(g) - sum(ok for _, ok in g) / len(g)) * len(g) / n
        for g in groups.values()
    )


@dataclass
class Quality:
    """One model's answers to one decision against its labels: counts and confidences."""

    outcomes: list[str]
    matrix: list[list[int]] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.matrix:
            self.matrix = [[0] * len(self.outcomes) for _ in self.outcomes]

    def _index(self, outcome: str) -> int:
        if outcome not in self.outcomes:
            self.outcomes.append(outcome)
            for row in self.matrix:
                row.append(0)
            self.matrix.append([0] * len(self.outcomes))
        return self.outcomes.index(outcome)

    def add(self, label: str, chosen: str, probabilities: Mapping[str, float] | None) -> None:
        """Count one answer; its confidence is the chosen outcome's probability, where given."""
        row, col = self._index(label), self._index(chosen)
        self.matrix[row][col] += 1
        if probabilities and chosen in probabilities:
            self.confidences.append(float(probabilities[chosen]))
            self.correct.append(label == chosen)

    @property
    def accuracy(self) -> float | None:
        return accuracy(self.matrix)

    @property
    def balanced_accuracy(self) -> float | None:
        return balanced_accuracy(self.matrix)

    @property
    def ece(self) -> float | None:
        # Only where every answer stated its probabilities: a partial ECE misleads.
        if len(self.confidences) != sum(sum(row) for row in self.matrix):
            return None
        return expected_calibration_error(self.confidences, self.correct)

    def to_json(self) -> dict[str, Any]:
        return {
            "accuracy": self.accuracy,
            "balanced_accuracy": self.balanced_accuracy,
            "expected_calibration_error": self.ece,
            "confusion": {
                label: dict(zip(self.outcomes, row, strict=True))
                for label, row in zip(self.outcomes, self.matrix, strict=True)
            },
        }
