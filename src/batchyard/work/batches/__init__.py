"""The work of deferred batches (seed 003): the market worker and what it needs.

``worker`` runs the passes (recover, housekeep, choose, claim, execute);
``housekeeping`` recovers lapsed leases and expires, cancels and purges;
``results`` settles or releases an item and seals its result; ``prices`` is
the market as the worker sees it (fresh route prices, fallbacks); ``feed``
polls the operator's price feed; ``memory`` saves and restores what a
learning policy saw; ``sealing`` resolves the batch encryption key.
"""
