"""The work of deferred batches (docs/reference/batches.md): their worker and what it needs.

``deferred_batch_worker`` runs the passes (recover, housekeep, choose, then the
runner's pipeline); ``item_queue`` is its lease queue; ``housekeeping``
recovers lapsed leases and expires, cancels and purges; ``results`` settles
or releases an item and seals its result; ``price_memory`` saves and restores
what a learning policy saw. What file batches share with them sits one level
up: ``work.market_prices`` (fresh route prices), ``work.price_feed`` (the
operator's feed) and ``work.batch_key`` (the batch encryption key).
"""
