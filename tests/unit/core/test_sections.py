"""The config sections as the parts read them: defaults, values taken by type, mistakes refused."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import TypeAdapter, ValidationError

from batchyard.core.config_errors import ConfigError, from_validation
from batchyard.core.sections import (
    FileBatchSettings,
    FileSettings,
    RunSettings,
    VersionSettings,
    WebhookSettings,
    parse_networks,
)


def test_each_value_takes_its_fields_type_and_the_rest_keep_their_defaults() -> None:
    got = TypeAdapter(FileBatchSettings).validate_python({"poll_s": 2, "concurrency": "8"})
    assert got == FileBatchSettings(poll_s=2.0, concurrency=8)
    assert isinstance(got.poll_s, float) and isinstance(got.concurrency, int)
    assert got.lease_s == FileBatchSettings().lease_s


def test_derived_values_of_a_section() -> None:
    assert RunSettings(quote_ttl_s=60).quote_ttl.total_seconds() == 60
    v = VersionSettings(max_lora_bytes=10, max_weights_bytes=20)
    assert (v.max_bytes, v.limit("lora"), v.limit("weights")) == (20, 10, 20)


@pytest.mark.parametrize(
    ("kind", "given", "field", "problem"),
    [
        (RunSettings, {"lease_s": 0}, "lease_s", "must be more than 0"),
        (FileSettings, {"max_lines": "many"}, "max_lines", "expected a whole number"),
        (FileSettings, {"max_line": 3}, "max_line", "is not a setting batchyard knows"),
        (WebhookSettings, {"jitter": 1.5}, "jitter", "must be less than 1"),
        (WebhookSettings, {"allowed_networks": ["nope"]}, "allowed_networks", "'nope'"),
        (
            WebhookSettings,
            {"allowed_networks": "10.0.0.0/8"},
            "allowed_networks",
            "expected a list",
        ),
        (VersionSettings, {"memory_budget_bytes": 0}, "memory_budget_bytes", "at least 1"),
    ],
)
def test_a_wrong_value_is_a_config_error_naming_the_field(kind, given, field, problem) -> None:
    with pytest.raises(ValidationError) as got:
        TypeAdapter(kind).validate_python(given)
    error = from_validation(got.value, model=kind)
    assert isinstance(error, ConfigError)
    assert error.field == field and problem in error.problem, error.line()


def test_networks_are_parsed_once_and_kept_as_networks() -> None:
    nets = parse_networks(["127.0.0.0/8", " 10.20.0.0/16 "])
    assert nets == (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("10.20.0.0/16"))
    assert parse_networks(nets) == nets
    assert WebhookSettings(allowed_networks=nets) == WebhookSettings(
        allowed_networks=["127.0.0.0/8", "10.20.0.0/16"]
    )
    with pytest.raises(ValueError, match="is not a CIDR block"):
        parse_networks([5])
