"""The catalog: what can be asked for, who serves it, and the config file that changes it."""

from __future__ import annotations

from decimal import Decimal

import pytest

from batchyard.core.catalog import (
    Catalog,
    ModelSpec,
    RouteSpec,
    catalog_from_config,
    default_catalog,
)
from batchyard.errors import InvalidRequest, ModelUnavailable, UnknownModel


def test_default_catalog_serves_kettei_core_on_the_embedded_model():
    cat = default_catalog()
    assert set(cat.models) == {"kettei-core", "kettei-chub", "kettei-fat"}
    route = cat.route_for("kettei-core")
    assert route.id == "embedded" and route.engine == "llama_cpp"
    assert route.hard_price_caps and route.data_retention == "none"
    assert cat.is_available("kettei-core")
    assert not cat.is_available("kettei-chub") and not cat.is_available("kettei-fat")
    core = cat.model("kettei-core")
    assert not core.reads_images
    assert cat.model("kettei-fat").reads_images
    # kettei-core is the cheapest (docs/reference/http.md).
    assert all(
        core.input_per_mtok <= m.input_per_mtok and core.output_per_mtok <= m.output_per_mtok
        for m in cat.models.values()
    )
    assert all(isinstance(m.input_per_mtok, Decimal) for m in cat.models.values())


def test_unknown_model_and_model_without_route_have_their_own_codes():
    cat = default_catalog()
    with pytest.raises(UnknownModel) as unknown:
        cat.model("gpt-nope")
    assert unknown.value.code == "unknown_model" and unknown.value.param == "model"
    with pytest.raises(ModelUnavailable) as unavailable:
        cat.route_for("kettei-fat")
    assert unavailable.value.code == "model_unavailable"
    for bad in ("", None, 3):
        with pytest.raises(InvalidRequest):
            cat.model(bad)


def _model(mid: str = "m") -> ModelSpec:
    return ModelSpec(mid, Decimal("1"), Decimal("2"), 1000)


@pytest.mark.parametrize(
    ("models", "routes", "message"),
    [
        ([_model(), _model()], [], "declared twice"),
        ([_model()], [RouteSpec("r", "x", "openai_http", "u")], "unknown model"),
        (
            [_model()],
            [RouteSpec("r", "m", "openai_http", "u"), RouteSpec("r", "m", "openai_http", "u")],
            "declared twice",
        ),
        (
            [_model()],
            [RouteSpec("r", "m", "openai_http", "u", fallbacks=("nowhere",))],
            "unknown route",
        ),
        ([_model(), ModelSpec("v", Decimal(1), Decimal(1), 10, type="version")], [], "base_model"),
    ],
)
def test_an_inconsistent_catalog_is_refused_at_build_time(models, routes, message):
    with pytest.raises(ValueError, match=message):
        Catalog(models, routes)


def test_config_routes_replace_the_defaults_and_models_merge():
    cat = catalog_from_config(
        {
            "models": [
                {"id": "kettei-fat", "input_per_mtok": "2.5"},
                {
                    "id": "my-model",
                    "input_per_mtok": 1,
                    "output_per_mtok": "3",
                    "context_window": 8192,
                },
            ],
            "routes": [
                {
                    "id": "vllm",
                    "model": "kettei-fat",
                    "engine": "openai_http",
                    "base_url": "http://gpu:8000/v1",
                    "upstream_model": "Qwen/Qwen2.5-72B",
                    "api_key_env": "VLLM_KEY",
                    "input_per_mtok": "0.2",
                    "output_per_mtok": "0.8",
                    "hard_price_caps": True,
                    "rpm": 600,
                    "tpm": 100000,
                    "concurrency": 8,
                    "timeout_s": 30,
                    "fallbacks": ["mine"],
                },
                {"id": "mine", "model": "my-model", "base_url": "http://x/v1"},
            ],
        }
    )
    fat = cat.model("kettei-fat")
    assert fat.input_per_mtok == Decimal("2.5")
    assert fat.output_per_mtok == Decimal("12.00")  # kept from the default
    assert fat.reads_images
    mine = cat.model("my-model")
    assert (mine.input_per_mtok, mine.output_per_mtok, mine.context_window) == (
        Decimal(1),
        Decimal(3),
        8192,
    )
    assert "embedded" not in cat.routes
    assert not cat.is_available("kettei-core")
    vllm = cat.route_for("kettei-fat")
    assert vllm.upstream_model == "Qwen/Qwen2.5-72B"
    assert vllm.input_per_mtok == Decimal("0.2") and vllm.hard_price_caps
    assert (vllm.rpm, vllm.tpm, vllm.concurrency, vllm.timeout_s) == (600, 100000, 8, 30.0)
    assert vllm.fallbacks == ("mine",)
    other = cat.route_for("my-model")
    assert other.engine == "openai_http" and other.upstream_model == "my-model"
    assert other.input_per_mtok is None  # pays the model's direct price


def test_config_without_routes_keeps_the_embedded_route():
    cat = catalog_from_config({})
    assert cat.route_for("kettei-core").id == "embedded"


@pytest.mark.parametrize("price", ["-1", "abc", "NaN"])
def test_config_prices_must_be_non_negative_decimals(price):
    with pytest.raises(ValueError):
        catalog_from_config(
            {"models": [{"id": "x", "input_per_mtok": price, "output_per_mtok": 1}]}
        )


def test_the_config_example_in_the_operate_guide_loads(tmp_path, monkeypatch):
    """docs/how-to/operate.md shows a config file; it must be one batchyard accepts."""
    from pathlib import Path

    from batchyard.core.config import load_settings

    page = Path(__file__).resolve().parents[3] / "docs" / "how-to" / "operate.md"
    text = page.read_text(encoding="utf-8")
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(example, encoding="utf-8")
    monkeypatch.delenv("BATCHYARD_DATABASE_URL", raising=False)
    monkeypatch.delenv("BATCHYARD_LIMITER_URL", raising=False)
    settings = load_settings(config_file=cfg)
    cat = settings.catalog
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.limiter_url == "redis://cache.internal:6379/0"
    assert set(cat.routes) == {"embedded", "vllm-a", "provider"}
    assert cat.route_for("llama-70b").api_key_env == "VLLM_API_KEY"
    assert cat.route_for("kettei-fat").input_per_mtok == Decimal("2.50")
    assert cat.is_available("kettei-core") and not cat.is_available("kettei-chub")
    assert [t.level for t in settings.tiers] == [0, 1]
    assert settings.tiers[1].min_purchased == Decimal(50)
