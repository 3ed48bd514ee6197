"""Engines turn one request into one completion; they know nothing of money or storage."""

import os

# llama.cpp's CPU backend runs its threads under OpenMP, whose idle threads spin
# by default between decodes. On a machine whose cores other work keeps busy
# the spinning thread takes the core the step loop needs (measured on the
# 2-core machine under load: 8 tokens took 74 s with two spinning threads,
# 2.7 s with passive ones). libgomp reads this once, when llama_cpp is first
# imported, and every import of it is below this package; an operator's own
# setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from batchyard.engines.protocol import (
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
