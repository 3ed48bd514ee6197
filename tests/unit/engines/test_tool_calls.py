"""A grammar-constrained tool answer read back: a cut plain reply is a reply, a cut call is not."""

from __future__ import annotations

import pytest

from batchyard.engines.tool_calls import parse_answer
from batchyard.errors import ModelOutputInvalid


def test_a_plain_reply_cut_at_max_tokens_comes_back_as_far_as_it_was_written() -> None:
    text, calls = parse_answer('{"content": "The weather in Paris is sun', finish_reason="length")
    assert (text, calls) == ("The weather in Paris is sun", None)


@pytest.mark.parametrize(
    ("cut", "kept"),
    [('{"content":"a\\', "a"), ('{"content":"caf\\u00e', "caf"), ('{"content": "', "")],
)
def test_an_escape_cut_in_two_is_left_out(cut: str, kept: str) -> None:
    assert parse_answer(cut, finish_reason="length") == (kept, None)


def test_a_cut_tool_call_is_model_output_invalid() -> None:
    with pytest.raises(ModelOutputInvalid):
        parse_answer('{"name": "get_weather", "argu', finish_reason="length")


def test_a_cut_answer_that_did_not_stop_at_the_limit_is_model_output_invalid() -> None:
    with pytest.raises(ModelOutputInvalid):
        parse_answer('{"content": "half', finish_reason="stop")


def test_whole_answers_parse_as_before() -> None:
    assert parse_answer('{"content": "hi"}', finish_reason="stop") == ("hi", None)
    text, calls = parse_answer('{"name": "f", "arguments": {"x": 1}}', finish_reason="stop")
    assert text == "" and calls is not None
    assert calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
