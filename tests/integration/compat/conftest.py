"""A live batchyard on default settings, for the clients people already use.

The server runs in a thread of its own with its own event loop, on a real
socket, with the embedded model and the default tiers: the SDKs bring their
own HTTP clients (and some of them are synchronous, or run threads), so they
must not share the test's event loop. One server serves the whole module; each
test gets an organisation of its own at tier 1, so one test's limits never
meet another's. The ledger is audited when the server stops.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.threaded_server import Gateway, ServerThread

# LiteLLM fetches a model price list from the network on import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    home = tmp_path_factory.mktemp("compat")
    old_home = os.environ.get("BATCHYARD_HOME")
    os.environ["BATCHYARD_HOME"] = str(home)
    server = ServerThread(home)
    try:
        yield server.start()
    finally:
        server.stop()
        if old_home is None:
            os.environ.pop("BATCHYARD_HOME", None)
        else:
            os.environ["BATCHYARD_HOME"] = old_home
    assert server.problems == [], server.problems
