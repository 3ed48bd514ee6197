"""``python -m batchyard`` is the ``batchyard`` command."""

from batchyard.cli.main import main

main()
