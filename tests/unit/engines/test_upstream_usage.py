"""An OpenAI-compatible upstream's ``usage`` as ``Usage``, its cached prompt tokens included."""

from __future__ import annotations

from typing import Any

import pytest

from batchyard.engines.openai_http import read_usage
from batchyard.engines.protocol import Usage


def test_the_cached_count_is_read_from_the_prompt_tokens_details() -> None:
    usage = {
        "prompt_tokens": 1200,
        "completion_tokens": 7,
        "total_tokens": 1207,
        "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
    }
    assert read_usage(usage) == Usage(1200, 7, 1024)


@pytest.mark.parametrize(
    "details",
    [None, {}, {"cached_tokens": None}, {"cached_tokens": 0}, "1024", [1024]],
)
def test_no_details_or_no_count_means_nothing_was_cached(details: Any) -> None:
    usage: dict[str, Any] = {"prompt_tokens": 12, "completion_tokens": 3}
    if details is not None:
        usage["prompt_tokens_details"] = details
    assert read_usage(usage) == Usage(12, 3, 0)


@pytest.mark.parametrize(("cached", "read"), [(-5, 0), (13, 12), (10**9, 12)])
def test_an_odd_cached_count_is_bounded_by_the_prompt(cached: int, read: int) -> None:
    """An upstream that says more than the prompt was cached still pays for no less than none."""
    usage = {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    assert read_usage(usage).cached_input_tokens == read


@pytest.mark.parametrize(
    "usage",
    [
        {"completion_tokens": 3},
        {"prompt_tokens": "many", "completion_tokens": 3},
        {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": "some"}},
    ],
)
def test_a_missing_or_mistyped_count_is_refused(usage: dict[str, Any]) -> None:
    with pytest.raises((KeyError, TypeError, ValueError)):
        read_usage(usage)
