"""The HTTP front doors: one router per door, sharing auth, errors and idempotency."""
