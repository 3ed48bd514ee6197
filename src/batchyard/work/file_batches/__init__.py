"""OpenAI-dialect file batches: lines claimed under leases, answered and settled."""
