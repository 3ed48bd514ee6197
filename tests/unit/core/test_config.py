"""The typed settings model: file and environment alike, and its reference page complete."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from batchyard.core.config import SettingsFile, env_var, load_settings
from batchyard.core.config_errors import ConfigError

PAGE = Path(__file__).resolve().parents[3] / "docs" / "reference" / "configuration.md"


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("BATCHYARD_") and name != "BATCHYARD_HOME":
            monkeypatch.delenv(name)


def test_every_setting_is_in_the_reference_with_its_variable():
    page = PAGE.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z_]+)` \|(.*)$", page, flags=re.M))
    for name in SettingsFile.model_fields:
        sections = ("models", "routes", "tiers", "runs", "file_batches", "files", "model_versions")
        if name in (*sections, "webhooks"):
            assert f"## `{name}:`" in page, name
            continue
        assert name in rows, f"{name} is missing from {PAGE.name}"
        assert f"`{env_var(name)}`" in rows[name], name


def test_a_file_value_is_read_and_the_environment_wins(tmp_path, monkeypatch):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("embedded_n_ctx: 4096\nembedded_contexts: 3\nshutdown_grace_s: 5\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert (s.embedded_n_ctx, s.embedded_slots, s.embedded_contexts) == (4096, 3, 3)
    assert s.shutdown_grace_s == 5
    monkeypatch.setenv("BATCHYARD_SHUTDOWN_GRACE_S", "7.5")
    monkeypatch.setenv("BATCHYARD_EMBEDDED_SLOTS", "16")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert (s.shutdown_grace_s, s.embedded_slots) == (7.5, 16)


def test_the_defaults_without_a_file():
    s = load_settings(database_url="sqlite://")
    assert (s.embedded_slots, s.embedded_n_ctx, s.embedded_prefill_tokens) == (8, 2048, 512)
    assert s.embedded_threads is None and s.embedded_cache_tokens is None
    assert s.embedded_shelf_mb == 256
    assert set(s.catalog.routes) == {"embedded"}


def test_the_shelf_size_is_read_and_checked(tmp_path, monkeypatch):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("embedded_shelf_mb: 0\n")
    assert load_settings(config_file=cfg, database_url="sqlite://").embedded_shelf_mb == 0
    monkeypatch.setenv("BATCHYARD_EMBEDDED_SHELF_MB", "1024")
    assert load_settings(config_file=cfg, database_url="sqlite://").embedded_shelf_mb == 1024
    monkeypatch.setenv("BATCHYARD_EMBEDDED_SHELF_MB", "-1")
    with pytest.raises(ConfigError) as got:
        load_settings(config_file=cfg, database_url="sqlite://")
    assert got.value.source == "environment variable BATCHYARD_EMBEDDED_SHELF_MB"
    assert got.value.field == "embedded_shelf_mb"


def test_an_error_names_its_source_and_field(tmp_path, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[routes]]\nid = "a"\nmodel = "kettei-core"\nengine = "warp_drive"\n')
    with pytest.raises(ConfigError) as got:
        load_settings(config_file=cfg, database_url="sqlite://")
    assert got.value.line() == (
        f"batchyard: config error in {cfg}: routes[0].engine: unknown engine 'warp_drive' "
        "(known: llama_cpp, openai_http, memory) — fix the route or remove it"
    )
    monkeypatch.setenv("BATCHYARD_EMBEDDED_THREADS", "0")
    with pytest.raises(ConfigError) as env:
        load_settings(database_url="sqlite://")
    assert env.value.source == "environment variable BATCHYARD_EMBEDDED_THREADS"
    assert env.value.field == "embedded_threads"


def test_sections_read_by_the_workers_are_checked_and_kept(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("runs: {lease_s: 2}\nfile_batches: {poll_s: '0.2'}\nfiles: {max_lines: 10}\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert s.raw["runs"] == {"lease_s": 2.0}
    assert s.raw["file_batches"] == {"poll_s": 0.2}
    assert s.raw["files"] == {"max_lines": 10}


def test_the_model_versions_section_is_checked_at_start(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model_versions: {idle_s: 120, memory_budget_bytes: 1000000}\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert s.raw["model_versions"] == {"idle_s": 120.0, "memory_budget_bytes": 1000000}
    for bad, field in (
        ("{idle_s: 0}", "model_versions.idle_s"),
        ("{memory_budget_bytes: -5}", "model_versions.memory_budget_bytes"),
        ("{idle: 60}", "model_versions.idle"),
    ):
        cfg.write_text(f"model_versions: {bad}\n")
        with pytest.raises(ConfigError) as got:
            load_settings(config_file=cfg, database_url="sqlite://")
        assert got.value.field == field, got.value.line()
        assert "\n" not in got.value.line()


def test_webhooks_allowed_networks_are_checked_at_start(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("webhooks:\n  allowed_networks: ['127.0.0.0/8', '10.0.0.300/8']\n")
    with pytest.raises(ConfigError) as got:
        load_settings(config_file=cfg, database_url="sqlite://")
    line = got.value.line()
    assert "webhooks.allowed_networks" in line and "'10.0.0.300/8'" in line
    assert "\n" not in line
    cfg.write_text("webhooks:\n  allowed_networks: ['127.0.0.0/8']\n  max_attempts: 3\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert s.raw["webhooks"] == {"allowed_networks": ["127.0.0.0/8"], "max_attempts": 3}
