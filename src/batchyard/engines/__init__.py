"""Engines turn one request into one completion; they know nothing of money or storage."""

from batchyard.engines.base import (
    Choice,
    Completion,
    CompletionRequest,
    Engine,
    RateLimitSignal,
    ScoringEngine,
    Usage,
)

__all__ = [
    "Choice",
    "Completion",
    "CompletionRequest",
    "Engine",
    "RateLimitSignal",
    "ScoringEngine",
    "Usage",
]
