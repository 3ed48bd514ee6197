"""The work of batch inference runs (seed 002): quoting, funding, executing, writing outputs.

``worker`` takes runs through leases and hands each to what it needs;
``quoting`` freezes and counts the selected rows; ``funding`` reserves a
confirmed run's quote or blocks it; ``executor`` answers the rows and
settles; ``outputs`` writes the answers where the run asked.
"""
