"""The body of a request to create a batch inference run, checked and normalised.

Every mistake a client can make in the body is answered here, before a run
exists, with a 400 whose ``param`` names the field and whose ``code`` says
what is wrong; the worker can then trust a run's ``spec`` as written.
"""

from __future__ import annotations

import json
from typing import Any

from batchyard.core.filters import RowFilter
from batchyard.core.runs import MAX_SAMPLES_PER_ROW, prompt_messages, resolve_model
from batchyard.errors import InvalidRequest, UnknownModel
from batchyard.store import projects as pstore

__all__ = ["any_row_matches", "validate_run_request"]


def _object(body: dict[str, Any], key: str, default: Any = None) -> dict[str, Any]:
    value = body.get(key, default)
    if not isinstance(value, dict):
        raise InvalidRequest(f"{key} must be an object", param=key)
    return value


def _int(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{param} must be an integer", param=param)
    return value


def _number(value: Any, param: str, low: float, high: float, *, open_low: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"{param} must be a number", param=param)
    if value > high or value < low or (open_low and value == low):
        bound = f"{'above' if open_low else 'at least'} {low} and at most {high}"
        raise InvalidRequest(f"{param} must be {bound}", param=param, code="sampling_out_of_range")
    return float(value)


def validate_run_request(svc: Any, body: dict[str, Any], ds: pstore.Dataset) -> dict[str, Any]:
    """The run's spec, normalised, or the 400 that explains what is wrong."""
    model_in = _object(body, "model")
    model, _, _ = resolve_model(svc.catalog, model_in, ds.org_id)
    if model.project_id is not None and model.project_id != ds.project_id:
        # docs/reference/runs.md: "a model version in this project".
        raise UnknownModel(
            f"model version {model.id} is not in project {ds.project_id}", param="model.id"
        )
    mode = _object(body, "mode", {"type": "single_turn"})
    if mode.get("type") != "single_turn":
        raise InvalidRequest(
            f"mode.type {mode.get('type')!r} is not supported; use single_turn",
            param="mode.type",
            code="unsupported_mode",
        )
    default_input = (
        {"type": "messages"} if ds.kind == "chat-sft" else {"type": "field", "field": "text"}
    )
    source = _object(body, "input", default_input)
    if source.get("type") == "messages":
        if "messages" not in ds.fields and ds.row_count:
            raise InvalidRequest(
                "the dataset's rows have no `messages` field",
                param="input",
                code="input_field_not_found",
            )
        source = {"type": "messages"}
    elif source.get("type") == "field":
        field = source.get("field")
        if not isinstance(field, str) or not field:
            raise InvalidRequest("input.field must name a field", param="input.field")
        if field not in ds.fields:
            raise InvalidRequest(
                f"the dataset has no field {field!r}",
                param="input.field",
                code="input_field_not_found",
            )
        source = {"type": "field", "field": field}
    else:
        raise InvalidRequest(
            "input.type must be messages or field", param="input.type", code="unsupported_input"
        )
    output = _object(body, "output")
    if output.get("type") == "field":
        out_field = output.get("field")
        if not isinstance(out_field, str) or not out_field or len(out_field) > 200:
            raise InvalidRequest("output.field must name a field", param="output.field")
        prompt_field = source.get("field", "messages")
        if out_field == prompt_field:
            raise InvalidRequest(
                f"output.field {out_field!r} would overwrite the prompt the rows are read from",
                param="output.field",
                code="output_overwrites_input",
            )
        output = {"type": "field", "field": out_field}
    elif output.get("type") == "dataset":
        name = output.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise InvalidRequest("output.name must be 1 to 200 characters", param="output.name")
        output = {"type": "dataset", "name": name.strip()}
    else:
        raise InvalidRequest(
            "output.type must be field or dataset",
            param="output.type",
            code="unsupported_output_type",
        )
    sampling = _object(body, "sampling", {})
    unknown = set(sampling) - {"maxOutputTokens", "samplesPerRow", "temperature", "topP"}
    if unknown:
        raise InvalidRequest(f"sampling has unknown fields {sorted(unknown)}", param="sampling")
    max_out = _int(
        sampling.get(
            "maxOutputTokens", min(svc.settings.default_max_tokens, model.max_output_tokens)
        ),
        "sampling.maxOutputTokens",
    )
    if not 1 <= max_out <= model.max_output_tokens:
        raise InvalidRequest(
            f"sampling.maxOutputTokens must be from 1 to {model.max_output_tokens} for {model.id}",
            param="sampling.maxOutputTokens",
            code="max_output_tokens_out_of_range",
        )
    samples = _int(sampling.get("samplesPerRow", 1), "sampling.samplesPerRow")
    if not 1 <= samples <= MAX_SAMPLES_PER_ROW:
        raise InvalidRequest(
            f"sampling.samplesPerRow must be from 1 to {MAX_SAMPLES_PER_ROW}",
            param="sampling.samplesPerRow",
            code="samples_per_row_out_of_range",
        )
    temperature = _number(sampling.get("temperature"), "sampling.temperature", 0, 2, open_low=False)
    top_p = _number(sampling.get("topP"), "sampling.topP", 0, 1, open_low=True)
    return {
        "model": {"type": model.type, "id": model.id},
        "mode": {"type": "single_turn"},
        "input": source,
        "output": output,
        "sampling": {
            "maxOutputTokens": max_out,
            "samplesPerRow": samples,
            "temperature": temperature,
            "topP": top_p,
        },
        "filter": body.get("filter"),
    }


def any_row_matches(svc: Any, dataset_id: str, keep: RowFilter, source: dict[str, Any]) -> bool:
    """Whether a current row passes the filter and has a prompt (runs on a thread).

    Checked before a run is created, so a filter that matches nothing is a 400
    at once rather than a run that fails while it is being quoted.
    """
    after = 0
    while True:
        batch = svc.db.read_sync(
            lambda c, a=after: pstore.current_rows(c, dataset_id, after=a, limit=2000)
        )
        if not batch:
            return False
        for _, _, raw in batch:
            data = json.loads(raw)
            if keep(data) and prompt_messages(data, source) is not None:
                return True
        after = batch[-1][0]
