"""The sync and async clients (and pacers) offer the same methods with the same parameters.

The sync modules are generated from the async ones, so this holds by
construction; the test is the net under the generator: a rule that stops
renaming, or a hand edit of a generated file, shows up here as a named
method and parameter rather than as a user's TypeError.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

from batchyard.client import AsyncClient, Client, Pacer, SyncPacer

#: The async name of a method, type or dunder -> its sync name.
SYNC_NAME = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "aclose": "close",
    "AsyncClient": "Client",
    "AsyncIterator": "Iterator",
    "Pacer": "SyncPacer",
    "PaceClock": "SyncPaceClock",
    "MonotonicClock": "SyncMonotonicClock",
}
_WORD = re.compile(r"\b(" + "|".join(map(re.escape, SYNC_NAME)) + r")\b")


def _sync_text(annotation: Any) -> str:
    """An async annotation written as its sync twin (annotations are strings here)."""
    return _WORD.sub(lambda m: SYNC_NAME[m.group(1)], str(annotation))


def _methods(cls: type) -> dict[str, Callable[..., Any]]:
    """Public methods and the protocol dunders a user relies on."""
    wanted_dunders = {"__init__", "__repr__", "__enter__", "__exit__", "__aenter__", "__aexit__"}
    return {
        name: member
        for name, member in vars(cls).items()
        if inspect.isfunction(member) and (not name.startswith("_") or name in wanted_dunders)
    }


def _shape(fn: Callable[..., Any], *, from_async: bool) -> list[tuple[str, str, Any, str]]:
    sig = inspect.signature(fn)
    text = _sync_text if from_async else str
    params = [(p.name, p.kind.name, p.default, text(p.annotation)) for p in sig.parameters.values()]
    return [*params, ("return", "", None, text(sig.return_annotation))]


PAIRS = [(AsyncClient, Client), (Pacer, SyncPacer)]


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=["client", "pacer"])
def test_same_public_methods(async_cls: type, sync_cls: type) -> None:
    async_names = {SYNC_NAME.get(n, n) for n in _methods(async_cls)}
    assert async_names == set(_methods(sync_cls))


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=["client", "pacer"])
def test_same_parameters_defaults_and_types(async_cls: type, sync_cls: type) -> None:
    sync_methods = _methods(sync_cls)
    for name, method in _methods(async_cls).items():
        twin = sync_methods[SYNC_NAME.get(name, name)]
        assert _shape(twin, from_async=False) == _shape(method, from_async=True), name


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=["client", "pacer"])
def test_what_is_awaited_in_one_is_a_plain_call_in_the_other(
    async_cls: type, sync_cls: type
) -> None:
    sync_methods = _methods(sync_cls)
    for name, method in _methods(async_cls).items():
        twin = sync_methods[SYNC_NAME.get(name, name)]
        if inspect.isasyncgenfunction(method):
            assert inspect.isgeneratorfunction(twin), name
        else:
            assert not inspect.iscoroutinefunction(twin), name
            assert inspect.isgeneratorfunction(twin) == inspect.isgeneratorfunction(method), name


def test_the_sync_decide_feeds_the_pacer_like_the_async_one() -> None:
    # The drift this issue found: the sync decide had no ``tokens``.
    assert "tokens" in inspect.signature(Client.decide).parameters
    assert "clock" in inspect.signature(Client.__init__).parameters
    assert "sleep" not in inspect.signature(Client.__init__).parameters
