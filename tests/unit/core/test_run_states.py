"""The run state machine: allowed moves, terminal states, messages, model resolution."""

from __future__ import annotations

import itertools
from decimal import Decimal

import pytest

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.runs import (
    LIVE,
    TERMINAL,
    TRANSITIONS,
    RunStatus,
    check_transition,
    message_for,
    prompt_messages,
    resolve_model,
)
from batchyard.errors import InvalidState

S = RunStatus

HAPPY = [
    S.PREPARING,
    S.AWAITING_CONFIRMATION,
    S.QUEUED,
    S.RUNNING,
    S.WRITING_OUTPUTS,
    S.COMPLETED,
]


def test_the_happy_path_is_allowed_step_by_step():
    for a, b in itertools.pairwise(HAPPY):
        check_transition(a, b)


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
def test_terminal_states_go_nowhere(terminal):
    for target in S:
        with pytest.raises(InvalidState):
            check_transition(terminal, target)


def test_every_live_state_can_stop_or_cancel_and_blocked_can_be_left():
    for state in LIVE:
        assert TRANSITIONS[state] & {S.STOPPING, S.CANCELED}, state
    assert {S.QUEUED, S.CANCELED} <= TRANSITIONS[S.BLOCKED]


@pytest.mark.parametrize(
    ("a", "b"),
    [(S.PREPARING, S.QUEUED), (S.AWAITING_CONFIRMATION, S.RUNNING), (S.QUEUED, S.COMPLETED)],
)
def test_skipping_a_step_is_invalid_state_409(a, b):
    with pytest.raises(InvalidState) as info:
        check_transition(a, b, run_id="bir.x")
    assert info.value.status == 409 and info.value.code == "invalid_state"
    assert "bir.x" in info.value.message


def test_messages_explain_each_status_and_block():
    for state in S:
        assert message_for(state)
    text = message_for("blocked", blocked_reason="billing_review", run_id="bir.1", max_cost="9")
    assert "batchyard runs approve bir.1" in text and "$9" in text
    assert "credit" in message_for("blocked", blocked_reason="funds")
    assert "3 of 10" in message_for("running", done=3, total=10)


def test_prompts_come_from_messages_or_a_text_field():
    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_messages({"messages": msgs}, {"type": "messages"}) == msgs
    assert prompt_messages({"messages": [{"role": "x"}]}, {"type": "messages"}) is None
    assert prompt_messages({"text": "hey"}, {"type": "field", "field": "text"}) == [
        {"role": "user", "content": "hey"}
    ]
    assert prompt_messages({"text": "  "}, {"type": "field", "field": "text"}) is None
    assert prompt_messages({"text": 3}, {"type": "field", "field": "text"}) is None


def _catalog():
    base = ModelSpec("m", Decimal(1), Decimal(2), 1000)
    version = ModelSpec("m-v1", Decimal(1), Decimal(2), 1000, type="version", base_model="m")
    orphan = ModelSpec("m-v2", Decimal(1), Decimal(2), 1000, type="version", base_model="m")
    route = RouteSpec(
        "r",
        "m",
        "openai_http",
        "up-m",
        base_url="http://x",
        version={"m-v1": {"upstream_model": "up-v1"}},
    )
    return Catalog([base, version, orphan], [route])


def test_models_resolve_by_type_to_their_route():
    cat = _catalog()
    assert resolve_model(cat, {"type": "base", "id": "m"})[2] == "up-m"
    spec, route, upstream = resolve_model(cat, {"type": "version", "id": "m-v1"})
    assert (spec.id, route.id, upstream) == ("m-v1", "r", "up-v1")


@pytest.mark.parametrize(
    ("model", "code"),
    [
        ({"type": "adapter", "id": "m"}, "unsupported_model_type"),
        ({"type": "version", "id": "m"}, "model_type_mismatch"),
        ({"type": "base", "id": "m-v1"}, "model_type_mismatch"),
        ({"type": "base", "id": "nope"}, "unknown_model"),
        ({"type": "version", "id": "m-v2"}, "model_unavailable"),
    ],
)
def test_bad_models_are_rejected_clearly(model, code):
    with pytest.raises(Exception) as info:
        resolve_model(_catalog(), model)
    # A model nobody serves is not found; the others are requests this model cannot take.
    assert info.value.code == code
    assert info.value.status == (404 if code == "unknown_model" else 400)
