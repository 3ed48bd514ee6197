"""Who may call what: one table of route × scope, read by ``authenticate`` and nothing else.

The three scopes mean:

- ``full``: everything the organisation can do;
- ``read``: reads everything (account, activity, models, projects, datasets,
  rows, runs, batches and their results) and never spends or changes anything;
- ``inference``: calls models on requests it sends itself (chat and text
  completions, embeddings, decide and its estimate, keep-warm, deferred and
  file batches, the files they read), and
  reads, cancels or deletes only the batches and files it created. It never
  reads customer data it did not send (projects, datasets, rows, runs, other
  keys' files and batches) nor the account or its activity, and it cannot
  create, confirm or cancel runs (they spend over a dataset).

Keeping the rules in one table (``ACCESS``) rather than in each handler means a
new route cannot forget its check: ``create_app`` refuses to start while an
app route has no row here, the matrix test walks every route × every scope,
and ``docs/reference/scopes.md`` is checked against this table.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from batchyard.core.accounts import Scope

__all__ = ["ACCESS", "Access", "access_for", "app_routes", "check_complete"]

F, R, INF = Scope.FULL, Scope.READ, Scope.INFERENCE


@dataclass(frozen=True, slots=True)
class Access:
    """How a route is authorised: by an API key of ``scopes``, by a workspace session, or open."""

    kind: Literal["key", "session", "public"]
    scopes: frozenset[Scope] = frozenset()
    #: Only objects the calling key created itself (inference keys and batches).
    own_only: frozenset[Scope] = frozenset()


def _key(*scopes: Scope, own: tuple[Scope, ...] = ()) -> Access:
    return Access("key", frozenset(scopes), frozenset(own))


PUBLIC = Access("public")
#: Workspace pages: signed in once with a full or inference key (``web.routes``).
SESSION = Access("session", frozenset((F, INF)), frozenset((INF,)))

_PROJECT = "/v1/projects/{project_id}"
_DATASET = _PROJECT + "/datasets/{dataset_id}"
_RUNS = _PROJECT + "/batch-inference-runs"
_HOOKS = "/v1/webhook-endpoints"
_HOOK = _HOOKS + "/{endpoint_id}"

#: (method, path) -> who may call it. HEAD is looked up as GET.
ACCESS: dict[tuple[str, str], Access] = {
    # health and the API's own description
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/readyz"): PUBLIC,
    # Prometheus scrapes; ``metrics_token`` puts it behind its own bearer token (app.py)
    ("GET", "/metrics"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    # the account (docs/reference/scopes.md: an inference key cannot read it)
    ("GET", "/v1/account"): _key(F, R),
    # spend caps: only a full key sets them
    ("PUT", "/v1/keys/{key_id}/spend-cap"): _key(F),
    ("PUT", "/v1/projects/{project_id}/spend-cap"): _key(F),
    ("GET", "/v1/activity"): _key(F, R),
    # models
    ("GET", "/v1/models"): _key(F, R, INF),
    ("GET", "/v1/models/{model_id}"): _key(F, R, INF),
    ("POST", "/v1/models/{model_id}/keep-warm"): _key(F, INF),
    # calling models on requests the caller sends
    ("POST", "/v1/chat/completions"): _key(F, INF),
    ("POST", "/v1/completions"): _key(F, INF),
    ("POST", "/v1/embeddings"): _key(F, INF),
    ("POST", "/v1/decide"): _key(F, INF),
    ("POST", "/v1/decide/estimate"): _key(F, INF),
    # Anthropic's Messages door: a call, and a count that runs no model
    ("POST", "/v1/messages"): _key(F, INF),
    ("POST", "/v1/messages/count_tokens"): _key(F, INF),
    # Anthropic's Message Batches (file batches underneath): an inference key sees its own
    ("POST", "/v1/messages/batches"): _key(F, INF),
    ("GET", "/v1/messages/batches"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/messages/batches/{batch_id}"): _key(F, R, INF, own=(INF,)),
    ("POST", "/v1/messages/batches/{batch_id}/cancel"): _key(F, INF, own=(INF,)),
    ("POST", "/v1/messages/batches/{batch_id}/retry"): _key(F, INF, own=(INF,)),
    ("GET", "/v1/messages/batches/{batch_id}/results"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/messages/batches/{batch_id}/finished"): _key(F, R, INF, own=(INF,)),
    # deferred batches: an inference key sees and cancels its own
    ("POST", "/v1/batches"): _key(F, INF),
    ("GET", "/v1/batches"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/batches/{batch_id}"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/batches/{batch_id}/results"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/batches/{batch_id}/finished"): _key(F, R, INF, own=(INF,)),
    ("POST", "/v1/batches/{batch_id}/cancel"): _key(F, INF, own=(INF,)),
    ("POST", "/v1/batches/{batch_id}/retry"): _key(F, INF, own=(INF,)),
    # OpenAI's Files, the input and output of file batches
    ("POST", "/v1/files"): _key(F, INF),
    ("GET", "/v1/files"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/files/{file_id}"): _key(F, R, INF, own=(INF,)),
    ("GET", "/v1/files/{file_id}/content"): _key(F, R, INF, own=(INF,)),
    ("DELETE", "/v1/files/{file_id}"): _key(F, INF, own=(INF,)),
    # projects, datasets and rows: customer data
    ("POST", "/v1/projects"): _key(F),
    ("GET", _PROJECT): _key(F, R),
    ("POST", _PROJECT + "/datasets"): _key(F),
    ("GET", _DATASET): _key(F, R),
    ("GET", _DATASET + "/rows"): _key(F, R),
    ("PATCH", _DATASET + "/rows/{row_id}"): _key(F),
    # model versions uploaded into a project: an inference key only names them as a model
    ("POST", _PROJECT + "/models"): _key(F),
    ("GET", _PROJECT + "/models"): _key(F, R),
    ("GET", _PROJECT + "/models/{version_id}"): _key(F, R),
    ("DELETE", _PROJECT + "/models/{version_id}"): _key(F),
    # batch inference runs over datasets
    ("POST", _RUNS): _key(F),
    ("GET", _RUNS): _key(F, R),
    ("GET", _RUNS + "/{run_id}"): _key(F, R),
    ("POST", _RUNS + "/{run_id}/confirm"): _key(F),
    ("POST", _RUNS + "/{run_id}/cancel"): _key(F),
    ("GET", _RUNS + "/{run_id}/failures"): _key(F, R),
    ("GET", _RUNS + "/{run_id}/finished"): _key(F, R),
    ("POST", _RUNS + "/{run_id}/retry"): _key(F),
    # webhook endpoints: where the organisation hears that its batches ended (secrets: full)
    ("POST", _HOOKS): _key(F),
    ("GET", _HOOKS): _key(F, R),
    ("GET", _HOOK): _key(F, R),
    ("DELETE", _HOOK): _key(F),
    ("POST", _HOOK + "/rotate-secret"): _key(F),
    # the Batches workspace (web/): a session opened with a full or inference key
    ("GET", "/workspace/"): PUBLIC,  # the sign-in form
    ("POST", "/workspace/sign-in"): SESSION,
    ("POST", "/workspace/sign-out"): SESSION,
    ("GET", "/workspace/batches"): SESSION,
    ("POST", "/workspace/batches"): SESSION,
    ("GET", "/workspace/batches/{batch_id}"): SESSION,
    ("POST", "/workspace/batches/{batch_id}/cancel"): SESSION,
    ("GET", "/workspace/batches/{batch_id}/results"): SESSION,
    ("POST", "/workspace/files"): SESSION,
    ("GET", "/workspace/files/{file_id}/content"): SESSION,
    ("GET", "/workspace/file-batches/{batch_id}"): SESSION,
    ("POST", "/workspace/file-batches/{batch_id}/cancel"): SESSION,
    ("GET", "/workspace/static/workspace.css"): PUBLIC,
}


def access_for(method: str, path: str) -> Access | None:
    """The row for a route (``path`` as declared, with ``{params}``); None if it has none."""
    return ACCESS.get(("GET" if method == "HEAD" else method, path))


def app_routes(app: Any) -> Iterator[tuple[str, str]]:
    """Every (method, path) an app serves, through included routers (HEAD left out)."""
    stack = list(app.router.routes)
    while stack:
        route = stack.pop()
        nested = getattr(route, "effective_candidates", None)
        if nested is not None:
            stack.extend(nested())
            continue
        path = getattr(route, "path", None)
        for method in getattr(route, "methods", None) or ():
            if path is not None and method != "HEAD":
                yield method, path


def check_complete(app: Any) -> None:
    """Refuse to build an app with a route the table does not cover."""
    missing = sorted(r for r in set(app_routes(app)) if access_for(*r) is None)
    if missing:
        raise RuntimeError(f"routes without a row in service.access.ACCESS: {missing}")
