"""Webhooks' rules: the signature a stock receiver checks, the retry schedule, the targets."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook

from batchyard.core.sections import WebhookSettings, parse_networks
from batchyard.core.webhook_rules import (
    EVENTS,
    address_allowed,
    event_for,
    new_secret,
    parse_target,
    retry_delay,
    sign,
)


def test_the_signature_is_the_one_standard_webhooks_computes():
    secret = new_secret()
    assert secret.startswith("whsec_")
    body = b'{"type":"batch.completed","data":{"id":"bat.1"}}'
    at = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    ours = sign(secret, "msg.1", int(at.timestamp()), body)
    theirs = Webhook(secret).sign("msg.1", at, body.decode())
    assert ours == theirs and ours.startswith("v1,")
    assert sign(new_secret(), "msg.1", int(at.timestamp()), body) != ours


def test_events_by_status_and_kind():
    assert event_for("completed", message_batch=False) == "batch.completed"
    assert event_for("canceled", message_batch=False) == "batch.cancelled"
    assert event_for("expired", message_batch=True) == "message_batch.ended"
    assert event_for("in_progress", message_batch=False) is None
    assert set(EVENTS) == {
        "batch.completed",
        "batch.failed",
        "batch.expired",
        "batch.cancelled",
        "message_batch.ended",
    }


def test_the_retry_schedule_grows_four_fold_is_capped_and_jittered():
    s = WebhookSettings()
    rand = random.Random(7)
    delays = [retry_delay(n, s, rand) for n in range(1, s.max_attempts)]
    bases = [min(s.max_delay_s, 5 * 4 ** (n - 1)) for n in range(1, s.max_attempts)]
    for got, base in zip(delays, bases, strict=True):
        assert base * 0.8 <= got <= base * 1.2
    # Ten attempts in all, spread over most of a day.
    assert 15 * 3600 < sum(bases) < 26 * 3600
    flat = WebhookSettings(jitter=0.0)
    assert retry_delay(1, flat, rand) == 5.0 and retry_delay(30, flat, rand) == 6 * 3600


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("93.184.215.14", True),
        ("2606:4700::1111", True),
        ("127.0.0.1", False),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:10.0.0.1", False),
        ("224.0.0.1", False),
        ("not an address", False),
    ],
)
def test_by_default_only_public_addresses_are_targets(address, allowed):
    assert address_allowed(address, ()) is allowed


def test_an_allowed_network_opens_its_addresses_only():
    nets = parse_networks(["127.0.0.0/8", "10.20.0.0/16"])
    assert address_allowed("127.0.0.1", nets) and address_allowed("10.20.3.4", nets)
    assert not address_allowed("10.21.0.1", nets)
    assert not address_allowed("169.254.169.254", nets)
    with pytest.raises(ValueError, match=r"10\.0\.0\.300/8"):
        parse_networks(["10.0.0.300/8"])


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://example.com/hook", "http:// or https://"),
        ("file:///etc/passwd", "http:// or https://"),
        ("https://user:pw@example.com/", "user name or password"),
        ("https:///nohost", "no host"),
        ("https://example.com/a#frag", "fragment"),
        ("https://exa mple.com/", "spaces"),
        ("https://example.com:99999/", "port"),
    ],
)
def test_a_url_that_is_not_a_target(url, problem):
    with pytest.raises(ValueError, match=problem):
        parse_target(url)


def test_a_target_has_its_port():
    assert parse_target("https://Example.com/hooks?x=1").port == 443
    assert parse_target("http://127.0.0.1:8080/h").host == "127.0.0.1"
