"""Stop strings over pieces, as a stream sees them, and the log-probability helpers."""

from __future__ import annotations

import math

import numpy as np

from batchyard.engines.llama_sampling import StopMatcher, log_softmax, top_logprobs


def feed_all(stops: list[str] | None, pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    shown: list[str] = []
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        shown.append(out)
        if stopped:
            return shown, True
    shown.append(matcher.flush())
    return shown, False


def test_a_stop_string_split_over_pieces_is_never_shown() -> None:
    shown, stopped = feed_all(["END"], ["Hello ", "wor", "ld E", "N", "D and more"])
    assert stopped
    assert "".join(shown) == "Hello world "
    # "E" and "EN" were held back until they turned out to be the stop string.
    assert shown[2] == "ld "


def test_held_text_that_is_not_a_stop_is_shown_later() -> None:
    shown, stopped = feed_all(["END"], ["abc E", "xit"])
    assert not stopped
    assert shown == ["abc ", "Exit", ""]


def test_without_stops_everything_passes_at_once() -> None:
    shown, stopped = feed_all(None, ["a", "b"])
    assert shown == ["a", "b", ""] and not stopped


def test_the_earliest_of_several_stops_wins() -> None:
    shown, stopped = feed_all(["\n\n", "Q:"], ["answer Q: more\n\n"])
    assert stopped and "".join(shown) == "answer "


def test_log_softmax_and_top_logprobs() -> None:
    row = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    lps = log_softmax(row)
    assert math.isclose(float(np.exp(lps).sum()), 1.0, rel_tol=1e-12)
    top = top_logprobs(lps, 2)
    assert [t for t, _ in top] == [1, 2]
    assert top[0][1] == float(lps[1]) and top_logprobs(lps, 0) == []


def test_the_stop_string_that_ended_the_text_is_named() -> None:
    # Two stop strings end in the same piece: the one that starts first is named.
    matcher = StopMatcher(["world", "lo w"])
    out, stopped = matcher.feed("Hello world")
    assert stopped and out == "Hel" and matcher.matched == "lo w"
    quiet = StopMatcher(["END"])
    quiet.feed("no stop here")
    assert quiet.matched is None


def test_only_a_chain_that_is_greedy_alone_picks_by_argmax() -> None:
    from batchyard.engines.llama_sampling import SamplingParams

    assert SamplingParams(temperature=0.0).plain_greedy
    assert not SamplingParams(temperature=0.2).plain_greedy
    assert not SamplingParams(temperature=0.0, grammar=object()).plain_greedy
    assert not SamplingParams(temperature=0.0, logit_bias={1: 5.0}).plain_greedy
    assert not SamplingParams(temperature=0.0, presence_penalty=0.5).plain_greedy
    assert not SamplingParams(temperature=0.0, frequency_penalty=0.5).plain_greedy
