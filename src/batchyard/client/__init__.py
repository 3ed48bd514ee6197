"""The batchyard client: SDK, text runner and model check, without the server's code.

Installs with ``pip install batchyard`` alone (httpx, click, rich, pyyaml);
Parquet input needs the ``parquet`` extra. Errors are the classes of
``batchyard.errors``, rebuilt from the wire code of each error body.
"""

from batchyard.client.async_client import AsyncClient
from batchyard.client.inputs import InputError, TextItem, load_decisions, read_texts
from batchyard.client.pacer import MonotonicClock, PaceClock, Pacer
from batchyard.client.retries import ConnectionFailed, RetryPolicy
from batchyard.client.sync_client import Client
from batchyard.client.sync_pacer import SyncMonotonicClock, SyncPaceClock, SyncPacer

__all__ = [
    "AsyncClient",
    "Client",
    "ConnectionFailed",
    "InputError",
    "MonotonicClock",
    "PaceClock",
    "Pacer",
    "RetryPolicy",
    "SyncMonotonicClock",
    "SyncPaceClock",
    "SyncPacer",
    "TextItem",
    "load_decisions",
    "read_texts",
]
