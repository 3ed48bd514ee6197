"""The settings' one declaration: read from the file and the environment, each mistake one line.

Each layer wins over the one before (defaults, file, environment, arguments),
and every way a value can be wrong is a ``ConfigError`` naming where it came
from, the field and the fix, in one line. The reference page's tables are
generated from the same declaration.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
from pydantic import ValidationError

from batchyard.core.config import Settings, env_names, load_settings
from batchyard.core.config_errors import ConfigError
from batchyard.core.sections import FileBatchSettings, RunSettings, WebhookSettings

DOCS = Path(__file__).resolve().parents[3] / "docs"
KEY = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="  # 32 bytes, base64


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("BATCHYARD_") and name != "BATCHYARD_HOME":
            monkeypatch.delenv(name)


def _file(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _refused(**kwargs) -> ConfigError:
    kwargs.setdefault("database_url", "sqlite://")
    with pytest.raises(ConfigError) as got:
        load_settings(**kwargs)
    line = got.value.line()
    assert "\n" not in line and line.startswith("batchyard: config error"), line
    assert "Traceback" not in line
    return got.value


# --- reading: the defaults, the file, the environment, the arguments ----------------------


def test_the_defaults_without_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHYARD_HOME", str(tmp_path))
    s = load_settings()
    assert s.database_url == f"sqlite:///{tmp_path / 'batchyard.db'}"
    assert s.home == tmp_path and s.config_file is None
    assert (s.embedded_slots, s.embedded_n_ctx, s.embedded_prefill_tokens) == (8, 2048, 512)
    assert s.embedded_threads is None and s.embedded_cache_tokens is None
    assert s.embedded_shelf_mb == 256 and s.privacy_default == "off"
    assert set(s.catalog.routes) == {"embedded"}
    assert s.runs == RunSettings() and s.webhooks == WebhookSettings()
    assert s.version_folder == tmp_path / "model-versions"


def test_a_yaml_or_toml_file_is_read(tmp_path):
    for name, text in (
        ("c.yaml", "embedded_n_ctx: 4096\nshutdown_grace_s: 5\nruns: {lease_s: 2}\n"),
        ("c.toml", "embedded_n_ctx = 4096\nshutdown_grace_s = 5\n[runs]\nlease_s = 2\n"),
    ):
        cfg = _file(tmp_path, text, name)
        s = load_settings(config_file=cfg, database_url="sqlite://")
        assert (s.embedded_n_ctx, s.shutdown_grace_s, s.config_file) == (4096, 5.0, str(cfg))
        assert s.runs == RunSettings(lease_s=2.0)


def test_the_config_file_can_come_from_its_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHYARD_CONFIG", str(_file(tmp_path, "max_body_bytes: 2048\n")))
    assert load_settings(database_url="sqlite://").max_body_bytes == 2048


def test_the_environment_wins_over_the_file_and_the_arguments_over_both(tmp_path, monkeypatch):
    cfg = _file(tmp_path, "shutdown_grace_s: 5\ndatabase_url: sqlite:///from-file.db\n")
    assert load_settings(config_file=cfg).database_url == "sqlite:///from-file.db"
    monkeypatch.setenv("BATCHYARD_SHUTDOWN_GRACE_S", "7.5")
    monkeypatch.setenv("BATCHYARD_DATABASE_URL", "sqlite:///from-env.db")
    s = load_settings(config_file=cfg)
    assert (s.shutdown_grace_s, s.database_url) == (7.5, "sqlite:///from-env.db")
    s = load_settings(config_file=cfg, database_url="sqlite:///from-flag.db", shutdown_grace_s=1)
    assert (s.shutdown_grace_s, s.database_url) == (1.0, "sqlite:///from-flag.db")


def test_an_empty_variable_is_an_unset_one(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHYARD_SHUTDOWN_GRACE_S", "")
    cfg = _file(tmp_path, "shutdown_grace_s: 5\n")
    assert load_settings(config_file=cfg, database_url="sqlite://").shutdown_grace_s == 5


def test_old_names_and_own_variables(tmp_path, monkeypatch):
    cfg = _file(tmp_path, "embedded_contexts: 3\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert (s.embedded_slots, s.embedded_contexts) == (3, 3)
    monkeypatch.setenv("BATCHYARD_EMBEDDED_CONTEXTS", "4")
    assert load_settings(config_file=cfg, database_url="sqlite://").embedded_slots == 4
    monkeypatch.setenv("BATCHYARD_EMBEDDED_SLOTS", "16")  # its own name wins over the old one
    assert load_settings(config_file=cfg, database_url="sqlite://").embedded_slots == 16
    assert load_settings(database_url="sqlite://", embedded_contexts=2).embedded_slots == 2
    err = _refused(config_file=_file(tmp_path, "embedded_contexts: 1000\n"))
    assert err.field == "embedded_contexts"  # the name the operator wrote
    assert env_names("embedded_slots") == (
        "BATCHYARD_EMBEDDED_SLOTS",
        "BATCHYARD_EMBEDDED_CONTEXTS",
    )
    assert env_names("embedded_model_path") == ("BATCHYARD_MODEL_PATH",)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("BATCHYARD_MODEL_PATH", str(model))
    assert load_settings(database_url="sqlite://").embedded_model_path == str(model)


def test_postgres_urls_run_on_psycopg_3():
    s = load_settings(database_url="postgresql://u@h/db")
    assert s.database_url == "postgresql+psycopg://u@h/db" and not s.is_sqlite
    assert load_settings(database_url="sqlite:///x/y.db").sqlite_path == Path("x/y.db")


def test_sections_are_read_into_the_parts_settings(tmp_path):
    cfg = _file(
        tmp_path,
        "runs: {lease_s: 2, concurrency: 4}\nfile_batches: {poll_s: '0.2'}\n"
        "files: {max_lines: 10}\nmodel_versions: {idle_s: 120, folder: /srv/mv}\n"
        "webhooks: {allowed_networks: ['127.0.0.0/8'], max_attempts: 3}\n"
        "tiers:\n  - {level: 0, requests_per_minute: 5, tokens_per_minute: 100}\n"
        "models:\n  - {id: kettei-core, context_window: 999}\n",
    )
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert s.runs == RunSettings(lease_s=2.0, concurrency=4)
    assert s.runs.quote_ttl.total_seconds() == 86400
    assert s.file_batches == FileBatchSettings(poll_s=0.2)
    assert (s.files.max_lines, s.files.max_bytes) == (10, 200 * 1024 * 1024)
    assert (s.model_versions.idle_s, s.version_folder) == (120.0, Path("/srv/mv"))
    assert [str(n) for n in s.webhooks.allowed_networks] == ["127.0.0.0/8"]
    assert s.webhooks.max_attempts == 3
    assert [(t.level, t.requests_per_minute, t.estimate_tokens_per_minute) for t in s.tiers] == [
        (0, 5, 1000)
    ]
    assert s.catalog.models["kettei-core"].context_window == 999


def test_a_model_on_the_embedded_engine_gets_the_engines_window_at_most(tmp_path):
    """The one preparation checks the catalog's window: it is never wider than the engine's."""
    s = load_settings(database_url="sqlite://", embedded_n_ctx=512)
    assert s.catalog.models["kettei-core"].context_window == 512
    assert s.catalog.models["kettei-fat"].context_window == 131072  # no embedded route
    cfg = _file(tmp_path, "models:\n  - {id: kettei-core, context_window: 999}\n")
    wide = load_settings(config_file=cfg, database_url="sqlite://", embedded_n_ctx=4096)
    assert wide.catalog.models["kettei-core"].context_window == 999


def test_a_section_with_nothing_under_it_is_the_defaults(tmp_path):
    cfg = _file(tmp_path, "runs:\nwebhooks:\nmodels:\ntiers:\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert s.runs == RunSettings() and s.webhooks == WebhookSettings()


def test_a_replaced_value_is_checked_like_a_files(tmp_path):
    s = load_settings(database_url="sqlite://")
    assert dataclasses.replace(s, embedded_slots=3).embedded_slots == 3
    with pytest.raises(ValidationError):
        dataclasses.replace(s, embedded_slots=0)
    with pytest.raises(ValidationError):
        dataclasses.replace(s, runs={"lease_s": -1})


# --- every way a value is wrong: one line, naming the source, the field and the fix --------


def test_a_file_that_cannot_be_read(tmp_path):
    missing = tmp_path / "nope.yaml"
    err = _refused(config_file=missing)
    assert (err.source, err.problem) == (str(missing), "the config file does not exist")
    assert "BATCHYARD_CONFIG" in err.fix
    err = _refused(config_file=tmp_path)  # a folder
    assert err.source == str(tmp_path) and "cannot be read" in err.problem
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"metrics_token: caf\xe9\n")
    assert "cannot be read" in _refused(config_file=latin).problem


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("c.yaml", "routes: [\n  - id: a\n", "not valid YAML at line"),
        ("c.toml", "routes = [ {id = 'a' \n", "not valid TOML"),
        ("c.yaml", "- a\n- b\n", "the file holds a list, not settings"),
    ],
)
def test_a_file_that_is_not_settings(tmp_path, name, text, problem):
    cfg = _file(tmp_path, text, name)
    err = _refused(config_file=cfg)
    assert err.source == str(cfg) and problem in err.problem


@pytest.mark.parametrize(
    ("text", "field", "problem", "fix"),
    [
        (
            "shutdown_grace: 5\n",
            "shutdown_grace",
            "not a setting",
            "did you mean 'shutdown_grace_s'",
        ),
        ("home: /tmp\n", "home", "not a setting", "remove it"),
        ("catalog: {}\n", "catalog", "not a setting", "remove it"),
        ("runs: {leas_s: 2}\n", "runs.leas_s", "not a setting", "did you mean 'lease_s'"),
        ("runs: 5\n", "runs", "expected a mapping", "name: value"),
        ("runs: {lease_s: soon}\n", "runs.lease_s", "expected a number", "such as 30"),
        ("files: {max_lines: 0}\n", "files.max_lines", "at least 1", "at least 1"),
        ("max_body_bytes: 1.5\n", "max_body_bytes", "whole number", "without a fraction"),
        ("embedded_slots: 999\n", "embedded_slots", "at most 256", "at most 256"),
        ("webhooks: {jitter: 1}\n", "webhooks.jitter", "less than 1", "less than 1"),
        ("billing_review_threshold: lots\n", "billing_review_threshold", "decimal", "0.50"),
        ("database_url: mysql://x\n", "database_url", "'mysql' is not a database", "sqlite"),
        ("limiter_url: memcached\n", "limiter_url", "unknown limiter", "redis://"),
        ("batch_encryption_key: short\n", "batch_encryption_key", "", "openssl rand"),
        ("market_policy: cheapest\n", "market_policy", "cheapest", "first_eligible"),
        ("privacy_default: shout\n", "privacy_default", "unknown privacy mode", "one of"),
        ("embedded_model_path: /no/such.gguf\n", "embedded_model_path", "not a file", "GGUF"),
        (
            "embedded_n_ctx: 4096\nembedded_cache_tokens: 1000\n",
            "embedded_cache_tokens",
            "less than one sequence",
            "at least 4096",
        ),
        ("routes: 5\n", "routes", "expected a list", "list"),
        (
            "routes:\n  - {id: a, model: kettei-core, engine: warp_drive}\n",
            "routes[0].engine",
            "unknown engine 'warp_drive'",
            "fix the route",
        ),
        (
            "routes:\n  - {id: a, model: kettei-huge, engine: memory}\n",
            "routes[0].model",
            "unknown model 'kettei-huge'",
            "",
        ),
        (
            "tiers:\n  - {level: 0, requests_per_minute: x, tokens_per_minute: 5}\n",
            "tiers[0].requests_per_minute",
            "expected a whole number, got 'x'",
            "",
        ),
        (
            "tiers:\n  - {level: 1, requests_per_minute: 5, tokens_per_minute: 5}\n",
            "tiers[0].level",
            "where tier 0 belongs",
            "from level 0 upwards",
        ),
        (
            "webhooks:\n  allowed_networks: ['127.0.0.0/8', '10.0.0.300/8']\n",
            "webhooks.allowed_networks",
            "'10.0.0.300/8'",
            "CIDR",
        ),
        (
            "model_versions: {memory_budget_bytes: -5}\n",
            "model_versions.memory_budget_bytes",
            "at least 1",
            "",
        ),
    ],
)
def test_a_wrong_value_in_the_file_is_one_line(tmp_path, text, field, problem, fix):
    cfg = _file(tmp_path, text)
    err = _refused(config_file=cfg)  # database_url too: a --database over it hides nothing
    assert (err.source, err.field) == (str(cfg), field), err.line()
    assert problem in err.problem and fix in err.fix, err.line()


def test_a_wrong_variable_names_the_variable(tmp_path, monkeypatch):
    cfg = _file(tmp_path, "embedded_threads: 2\n")
    for var, value, field in (
        ("BATCHYARD_SHUTDOWN_GRACE_S", "soon", "shutdown_grace_s"),
        ("BATCHYARD_EMBEDDED_THREADS", "0", "embedded_threads"),
        ("BATCHYARD_EMBEDDED_CONTEXTS", "many", "embedded_slots"),
        ("BATCHYARD_LIMITER_URL", "memcached", "limiter_url"),
    ):
        monkeypatch.setenv(var, value)
        err = _refused(config_file=cfg)
        assert (err.source, err.field) == (f"environment variable {var}", field), err.line()
        monkeypatch.delenv(var)


def test_a_mistake_under_a_later_layer_is_still_refused(tmp_path, monkeypatch):
    cfg = _file(tmp_path, "shutdown_grace_s: soon\n")
    monkeypatch.setenv("BATCHYARD_SHUTDOWN_GRACE_S", "5")
    err = _refused(config_file=cfg)
    assert (err.source, err.field) == (str(cfg), "shutdown_grace_s")
    monkeypatch.setenv("BATCHYARD_LIMITER_URL", "memcached")
    err = _refused(config_file=_file(tmp_path, "embedded_slots: 2\n"), limiter_url="sql")
    assert err.source == "environment variable BATCHYARD_LIMITER_URL"
    monkeypatch.delenv("BATCHYARD_LIMITER_URL")
    monkeypatch.setenv("BATCHYARD_EMBEDDED_CACHE_TOKENS", "2000")  # checked with the rest
    cfg = _file(tmp_path, "embedded_n_ctx: 512\nembedded_cache_tokens: 1000\n")
    assert load_settings(config_file=cfg, database_url="sqlite://").embedded_cache_tokens == 2000


def test_a_wrong_argument_names_the_flag(monkeypatch):
    err = _refused(database_url="mysql://x")
    assert (err.source, err.field) == ("--database", "database_url")
    monkeypatch.setenv("BATCHYARD_DATABASE_URL", "mysql://x")
    assert _refused(database_url="mysql://x").source == (
        "environment variable BATCHYARD_DATABASE_URL"
    )


def test_more_problems_are_counted_and_the_line_is_as_documented(tmp_path):
    cfg = _file(tmp_path, "shutdown_grace: 5\nembedded_slots: 0\n")
    assert "(1 more problem(s) after this one)" in _refused(config_file=cfg).fix
    cfg = _file(
        tmp_path, '[[routes]]\nid = "a"\nmodel = "kettei-core"\nengine = "warp_drive"\n', "c.toml"
    )
    assert _refused(config_file=cfg).line() == (
        f"batchyard: config error in {cfg}: routes[0].engine: unknown engine 'warp_drive' "
        "(known: llama_cpp, openai_http, memory) — fix the route or remove it"
    )


def test_a_good_key_and_model_file_are_taken(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    cfg = _file(tmp_path, f"batch_encryption_key: {KEY}\nembedded_model_path: {model}\n")
    s = load_settings(config_file=cfg, database_url="sqlite://")
    assert (s.batch_encryption_key, s.embedded_model_path) == (KEY, str(model))


# --- the reference page ----------------------------------------------------------------------


def _generator():
    import sys

    sys.path.insert(0, str(DOCS))
    spec = importlib.util.spec_from_file_location("gen_config", DOCS / "gen_config.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_generated_from_the_declaration():
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    assert gen.render(page) == page, "run `python docs/gen_config.py --write`"
    assert gen._check_rows(page) == []
    for name in Settings.__pydantic_fields__:
        info = Settings.__pydantic_fields__[name]
        derived = isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("derived")
        assert derived or f"`{name}`" in page, name


def test_the_page_check_finds_a_missing_row():
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8").replace("| `tokenizer` |", "| `tokeniser` |")
    assert gen._check_rows(page) == [
        "models: the field 'tokenizer' has no row",
        "models: the row 'tokeniser' is no field",
    ]
