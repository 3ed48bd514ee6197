"""Batch inference runs (docs/reference/runs.md): quoting, funding, executing, writing outputs.

``run_worker`` takes runs through leases and hands each to what it needs;
``quoting`` freezes and counts the selected rows; ``funding`` reserves a
confirmed run's quote or blocks it; ``executor`` answers the rows and
settles; ``outputs`` writes the answers where the run asked.
"""
