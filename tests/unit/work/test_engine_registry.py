"""Every route is checked at start: a route that could never get an engine is refused."""

from __future__ import annotations

import dataclasses

import pytest

from batchyard.core.catalog import Catalog, RouteSpec, default_catalog
from batchyard.core.config_errors import ConfigError
from batchyard.engines.scripted import ScriptedEngine
from batchyard.work.engines import EngineRegistry


def _catalog(route: RouteSpec) -> Catalog:
    return Catalog(default_catalog().models.values(), [route])


def _route(**fields: object) -> RouteSpec:
    base = RouteSpec(id="r", model="kettei-core", engine="openai_http", upstream_model="m")
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("route", "field", "words"),
    [
        (_route(engine="warp_drive"), "routes[0].engine", "unknown engine 'warp_drive'"),
        (_route(base_url=None), "routes[0].base_url", "no base URL"),
        (
            _route(base_url="http://127.0.0.1:9/v1", api_key_env="BY_UNIT_UNSET"),
            "routes[0].api_key_env",
            "BY_UNIT_UNSET is not set",
        ),
    ],
)
def test_a_route_that_cannot_get_an_engine_is_refused(route, field, words, monkeypatch):
    monkeypatch.delenv("BY_UNIT_UNSET", raising=False)
    with pytest.raises(ConfigError) as got:
        EngineRegistry().check(_catalog(route))
    assert got.value.field == field and words in got.value.problem


def test_a_route_with_an_engine_put_behind_it_needs_nothing_more():
    route = _route(engine="warp_drive")
    EngineRegistry(overrides={"r": ScriptedEngine()}).check(_catalog(route))


async def test_a_memory_route_gets_the_scripted_engine():
    registry = EngineRegistry()
    route = _route(engine="memory")
    registry.check(_catalog(route))
    assert isinstance(registry.for_route(route), ScriptedEngine)
    await registry.aclose()
