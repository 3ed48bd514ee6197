"""Engines turn one request into one completion; they know nothing of money or storage."""

import os

# llama.cpp's CPU backend runs its threads under OpenMP (libgomp in the wheel this
# project builds), and how its idle threads wait decides the embedded model's speed.
# libgomp's default spin takes the cores a loaded machine's step loop and event loop
# need; a passive wait sleeps between the operations inside one decode; a bounded
# spin (``GOMP_SPINCOUNT=50000``) bridges the gaps inside a decode and the step
# loop's work between two, then sleeps (docs/explanation/embedded-speed.md has the
# measurements). libgomp reads this once, when llama_cpp is first imported, and every
# import of it is below this package. An operator's own OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins (GOMP_SPINCOUNT overrides the policy in libgomp, so it is left
# unset then).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "50000")

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
