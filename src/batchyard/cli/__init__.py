"""The ``batchyard`` command: one module per command group."""
