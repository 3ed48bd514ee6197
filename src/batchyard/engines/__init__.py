"""Engines turn one request into one completion; they know nothing of money or storage."""

import os

# llama.cpp's CPU backend runs its threads under OpenMP (libgomp in the wheel this
# project builds). How its idle threads wait decides the embedded model's speed:
#
# - libgomp's default spins about 300,000 times before sleeping, long enough to
#   spin across the gap between two decodes. On a machine whose cores other work
#   keeps busy the spinning thread takes the core the step loop and the event
#   loop need (measured under load: 8 tokens took 74 s).
# - ``OMP_WAIT_POLICY=PASSIVE`` (this project's earlier default) sleeps at once,
#   also between the dozens of operations inside one decode: one sequence
#   decoded at a third of the speed the cores allow (33 against 94 tokens/s on
#   the quiet 2-core machine).
# - A bounded spin (``GOMP_SPINCOUNT=50000``) bridges the gaps inside a decode
#   and the step loop's own work between two decodes (a tenth of a millisecond
#   or two), then sleeps: as fast as the default on quiet cores, and the best
#   with two CPU-busy processes on the same cores. A shorter spin (10,000, the
#   earlier default) let the helper thread fall asleep between two decodes of a
#   lone sequence, and waking it cost every token: 5-10 % slower quiet
#   (docs/explanation/embedded-speed.md has the tables).
#
# libgomp reads this once, when llama_cpp is first imported, and every import of
# it is below this package. An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT
# wins (GOMP_SPINCOUNT overrides the policy in libgomp, so it is left unset then).
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
