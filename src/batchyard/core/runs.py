"""The batch inference run's state machine, and its rows' (pure: no I/O).

A run moves ``preparing → awaiting_confirmation → queued → running →
writing_outputs → completed``. It is ``failed`` when it cannot go on, and any
live state can be stopped (``stopping → canceled``; a run nobody is working on
is canceled at once). ``blocked`` holds a run until its cause is cleared:
``funds`` (the quote could not be reserved), ``payment`` (the usage could not
be settled) or ``billing_review`` (an operator must approve a large quote).

Each row of a run is a work item: ``pending → dispatched → succeeded |
failed | uncertain``. ``uncertain`` is a row whose call was in flight when
its worker died: it may have been answered and billed upstream, so it is
never sent again silently; the user decides (see docs/reference/runs.md).
A dispatched row whose call never started (its worker stopped while it
waited for its turn) goes back to ``pending``. Rows not yet sent when a run
stops are ``canceled``.

Keeping the rules here, apart from the store, lets one table answer "may this
move happen?" for the API, the worker and the operator CLI alike.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.errors import InvalidRequest, InvalidState, ModelUnavailable

__all__ = [
    "LIVE",
    "MAX_SAMPLES_PER_ROW",
    "TERMINAL",
    "TRANSITIONS",
    "BlockedReason",
    "ItemState",
    "RunStatus",
    "check_transition",
    "message_for",
    "prompt_messages",
    "prompt_text",
    "resolve_model",
]

MAX_SAMPLES_PER_ROW = 8


class RunStatus(StrEnum):
    PREPARING = "preparing"
    AWAITING_CONFIRMATION = "awaiting_confirmation"
    QUEUED = "queued"
    RUNNING = "running"
    WRITING_OUTPUTS = "writing_outputs"
    STOPPING = "stopping"
    BLOCKED = "blocked"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"


class BlockedReason(StrEnum):
    FUNDS = "funds"
    PAYMENT = "payment"
    BILLING_REVIEW = "billing_review"
    SPEND_CAP = "spend_cap"


class ItemState(StrEnum):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNCERTAIN = "uncertain"
    CANCELED = "canceled"


S = RunStatus
TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.CANCELED})
LIVE = frozenset(set(S) - TERMINAL)

TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    S.PREPARING: frozenset({S.AWAITING_CONFIRMATION, S.FAILED, S.CANCELED}),
    S.AWAITING_CONFIRMATION: frozenset({S.QUEUED, S.BLOCKED, S.FAILED, S.CANCELED}),
    # blocked → blocked: the reason changes (billing_review approved, then funds).
    S.BLOCKED: frozenset({S.BLOCKED, S.QUEUED, S.COMPLETED, S.FAILED, S.CANCELED}),
    S.QUEUED: frozenset({S.RUNNING, S.FAILED, S.CANCELED}),
    # running → running: a worker takes over a run whose lease expired.
    S.RUNNING: frozenset({S.RUNNING, S.WRITING_OUTPUTS, S.STOPPING, S.FAILED}),
    S.WRITING_OUTPUTS: frozenset(
        {S.WRITING_OUTPUTS, S.COMPLETED, S.STOPPING, S.BLOCKED, S.FAILED, S.CANCELED}
    ),
    S.STOPPING: frozenset({S.STOPPING, S.CANCELED, S.BLOCKED, S.FAILED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELED: frozenset(),
}

ITEM_TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    ItemState.PENDING: frozenset({ItemState.DISPATCHED, ItemState.FAILED, ItemState.CANCELED}),
    # dispatched → pending: the call was never sent (its worker stopped first).
    ItemState.DISPATCHED: frozenset(
        {ItemState.PENDING, ItemState.SUCCEEDED, ItemState.FAILED, ItemState.UNCERTAIN}
    ),
    ItemState.SUCCEEDED: frozenset(),
    ItemState.FAILED: frozenset(),
    ItemState.UNCERTAIN: frozenset(),
    ItemState.CANCELED: frozenset(),
}


def check_transition(current: str, target: str, *, run_id: str = "the run") -> None:
    """Raise 409 ``invalid_state`` unless ``current → target`` is allowed."""
    try:
        allowed = TRANSITIONS[RunStatus(current)]
    except ValueError:
        raise InvalidState(f"{run_id} is in an unknown state {current!r}") from None
    if RunStatus(target) not in allowed:
        raise InvalidState(
            f"{run_id} is {current} and cannot become {target}",
            details={"status": current},
        )


_MESSAGES = {
    S.PREPARING: "Freezing the selected rows and counting their tokens to prepare a quote.",
    S.AWAITING_CONFIRMATION: (
        "The quote is ready: confirm it before {expires} to reserve up to ${max_cost} "
        "and start inference."
    ),
    S.QUEUED: "Confirmed and funded; waiting for a worker to start answering rows.",
    S.RUNNING: "Answering rows: {done} of {total} done, {failed} failed.",
    S.WRITING_OUTPUTS: "All rows are answered; writing the completions to their destination.",
    S.BLOCKED: "Blocked until its cause is cleared.",
    S.STOPPING: (
        "Canceling: calls already sent are finishing; answered rows are kept and charged, "
        "the rest is released."
    ),
    S.COMPLETED: "Completed: {done} rows answered, {failed} failed; charged ${charge}.",
    S.FAILED: "Failed: {error}",
    S.CANCELED: "Canceled: answered rows were kept and charged (${charge}); the rest released.",
}
_BLOCKED = {
    BlockedReason.FUNDS: (
        "Blocked: the credit available cannot cover the quote of ${max_cost}; "
        "the run continues by itself once credit is added."
    ),
    BlockedReason.PAYMENT: (
        "Blocked: the usage of this run could not be settled; it is retried automatically "
        "and an operator can check the ledger."
    ),
    BlockedReason.BILLING_REVIEW: (
        "Blocked: the quote of ${max_cost} is above this deployment's review threshold; "
        "an operator approves it with `batchyard runs approve {run_id}`."
    ),
    BlockedReason.SPEND_CAP: (
        "Blocked: the quote of ${max_cost} would cross a spend cap of its project or key; "
        "the run continues by itself once the cap is raised or its month turns."
    ),
}


def message_for(
    status: str,
    *,
    blocked_reason: str | None = None,
    run_id: str = "",
    max_cost: str | None = None,
    expires: str | None = None,
    done: int = 0,
    failed: int = 0,
    total: int = 0,
    charge: str | None = None,
    error: str | None = None,
) -> str:
    """The ``message`` of a run: its status explained in words."""
    st = RunStatus(status)
    if st is S.BLOCKED and blocked_reason:
        template = _BLOCKED[BlockedReason(blocked_reason)]
    else:
        template = _MESSAGES[st]
    return template.format(
        run_id=run_id,
        max_cost=max_cost or "0",
        expires=expires or "the quote expires",
        done=done,
        failed=failed,
        total=total,
        charge=charge or "0",
        error=error or "the run could not go on",
    )


def prompt_text(data: dict[str, Any], field: str) -> str | None:
    """A row's prompt from a text field; ``None`` when it has none to send."""
    value = data.get(field)
    return value if isinstance(value, str) and value.strip() else None


def _valid_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant", "developer")
            and isinstance(m.get("content"), str | list)
            for m in value
        )
    )


def prompt_messages(data: dict[str, Any], source: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages a row sends, from its ``messages`` or a text field.

    ``None`` means the row has no usable prompt: it is left out of the quote
    rather than paid for and failed.
    """
    if source.get("type") == "messages":
        messages = data.get("messages")
        return messages if _valid_messages(messages) else None
    text = prompt_text(data, str(source.get("field")))
    return None if text is None else [{"role": "user", "content": text}]


def resolve_model(
    catalog: Catalog, model: dict[str, Any], org_id: str | None = None
) -> tuple[ModelSpec, RouteSpec, str]:
    """The catalog model a run names, the route that serves it, and the upstream name.

    A model version is served by a route of its own, or by a route of its base
    model that lists it under ``version`` (a LoRA adapter or full weights); a
    version uploaded into a project is only ``org_id``'s.
    """
    kind, model_id = model.get("type"), model.get("id")
    if kind not in ("base", "version"):
        raise InvalidRequest(
            f"model.type {kind!r} is not supported; use base or version",
            param="model.type",
            code="unsupported_model_type",
        )
    spec = catalog.model(model_id, org_id)
    if spec.type != kind:
        raise InvalidRequest(
            f"{spec.id} is a {spec.type} model, not a {kind}; send model.type {spec.type!r}",
            param="model.type",
            code="model_type_mismatch",
        )
    try:
        route, upstream = catalog.serving(spec.id)
    except ModelUnavailable:
        raise ModelUnavailable(
            f"model {spec.id!r} has no route configured on this deployment", param="model.id"
        ) from None
    return spec, route, upstream
