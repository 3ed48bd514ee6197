"""Model versions in a project: take in a GGUF, show, list, delete, and serve it.

``take_in`` checks an uploaded file on a thread before anything is kept (a real GGUF,
an adapter that loads on its base, weights whose tokenizer loads, since quotes count
with it); anything that fails removes the file, so a refused upload leaves neither file
nor row. A delete is seen by every process: the engine asks ``gate`` (one read by key)
before each use of a version and at each idle sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import unicodedata
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.catalog import PROJECT_VERSION_PREFIX, Catalog, ModelSpec
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.runs import TERMINAL
from batchyard.core.sections import VersionSettings
from batchyard.engines import gguf_files
from batchyard.engines.model_files import sha256_of
from batchyard.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from batchyard.service.deployment import Service
from batchyard.store import model_versions as store
from batchyard.store import projects as project_store
from batchyard.store.database import Database

__all__ = [
    "TYPES",
    "check_fields",
    "delete",
    "discard_spool",
    "fetcher",
    "folder_of",
    "gate",
    "get",
    "list_views",
    "org_versions",
    "resolve",
    "settings_of",
    "spool",
    "take_in",
    "version_view",
]

log = logging.getLogger("batchyard.model_versions")

TYPES = ("lora", "weights")


def settings_of(svc: Service) -> VersionSettings:
    return svc.settings.model_versions


def folder_of(svc: Service) -> Path:
    return svc.settings.version_folder


def spool(folder: Path) -> Callable[[], IO[bytes]]:
    """Temporary files for the upload in ``folder`` itself, so accepting one is a rename."""

    def make() -> IO[bytes]:
        folder.mkdir(parents=True, exist_ok=True)
        return tempfile.NamedTemporaryFile(
            dir=folder, prefix=".upload-", suffix=".part", delete=False
        )

    return make


def version_view(row: store.VersionRow) -> dict[str, Any]:
    """The model version object."""
    return {
        "id": row.id,
        "object": "model_version",
        "project_id": row.project_id,
        "type": row.type,
        "base": row.base,
        "name": row.name,
        "bytes": row.bytes,
        "sha256": row.sha256,
        "architecture": row.architecture,
        "created_at": isoformat(row.created_at),
        "status": "deleted" if row.deleted_at is not None else "ready",
    }


# -- checks -----------------------------------------------------------------------


def _name(value: str | None, filename: str) -> str:
    """The version's name: given, or the file's; never a path, never control characters."""
    for given, param in ((value, "name"), (filename or None, "file")):
        if given is None:
            continue
        if (
            "/" in given
            or "\\" in given
            or given in (".", "..")
            or any(unicodedata.category(ch).startswith("C") for ch in given)
        ):
            raise InvalidRequest(
                f"the {param} name must be a plain name, not a path: {given[:80]!r}",
                param=param,
                code="invalid_name",
            )
    name = (value if value is not None else filename).strip()
    if not 1 <= len(name) <= 200:
        if value is None:
            return "model version"
        raise InvalidRequest(
            "name is a string of 1 to 200 characters", param="name", code="invalid_name"
        )
    return name


def _base(catalog: Catalog, base: str | None) -> ModelSpec:
    """The catalog base model and the GGUF its embedded route runs."""
    if not base:
        raise InvalidRequest("base is required: a catalog model ID", param="base")
    spec = catalog.find(base)
    if spec is None or spec.organization is not None:
        raise InvalidRequest(
            f"base {base[:80]!r} is not a catalog model; GET /v1/models lists them",
            param="base",
            code="unknown_model",
        )
    if spec.type != "base":
        raise InvalidRequest(
            f"{spec.id} is itself a version; a version's base is a base model",
            param="base",
            code="model_type_mismatch",
        )
    routes = [r for r in catalog.routes.values() if r.model == spec.id]
    if not routes or routes[0].engine != "llama_cpp":
        raise InvalidRequest(
            f"{spec.id} is not served by the embedded engine here, which is the one that "
            "loads uploaded versions",
            param="base",
            code="versions_unsupported",
        )
    return spec


def _type(value: str | None) -> str:
    if value not in TYPES:
        raise InvalidRequest(
            "type is lora (an adapter on the base) or weights (a whole model)",
            param="type",
            code="invalid_model_type",
        )
    return value


def check_fields(svc: Service, fields: dict[str, str]) -> tuple[str, ModelSpec]:
    """The type and base of an upload, checked before its file is read."""
    kind = _type(fields.get("type"))
    base = _base(svc.catalog, fields.get("base"))
    return kind, base


def _check_weights(path: Path, header: gguf_files.GgufHeader) -> None:
    if header.string("general.type") == "adapter":
        raise InvalidRequest(
            "the file is an adapter; upload it with type=lora",
            param="type",
            code="model_type_mismatch",
        )
    if not header.architecture:
        raise InvalidRequest(
            "the GGUF file names no general.architecture", param="file", code="invalid_model_file"
        )
    if not isinstance(header.metadata.get("tokenizer.ggml.tokens"), list):
        raise InvalidRequest(
            "the weights carry no tokenizer (tokenizer.ggml.tokens); quotes count with it",
            param="file",
            code="tokenizer_missing",
        )
    from batchyard.engines.tokenizers import GgufTokenizer

    try:
        GgufTokenizer(path).count("ready")
    except (ValueError, OSError, RuntimeError) as exc:
        raise InvalidRequest(
            f"the weights' tokenizer does not load: {exc}", param="file", code="tokenizer_missing"
        ) from None


def _embedded_path(svc: Service) -> Path:
    from batchyard.engines.model_files import default_model_path

    given = svc.settings.embedded_model_path
    return Path(given) if given else default_model_path()


def take_in(
    svc: Service,
    principal: Principal,
    project_id: str,
    upload_path: Path,
    size: int,
    *,
    fields: dict[str, str],
    filename: str,
) -> dict[str, Any]:
    """Check the uploaded file and keep it as a version, or keep nothing (on a thread).

    ``upload_path`` is removed on every path but success, where it becomes the
    version's file.
    """
    kept = False
    try:
        svc.db.read_sync(lambda c: project_store.get_project(c, principal.org_id, project_id))
        kind, base = check_fields(svc, fields)
        name = _name(fields.get("name"), filename)
        limits = settings_of(svc)
        if size > limits.limit(kind):
            raise PayloadTooLarge(
                f"a {kind} file is at most {limits.limit(kind)} bytes; this one is {size}",
                param="file",
                code="file_too_large",
            )
        if size == 0:
            raise InvalidRequest("the upload has no file part", param="file", code="not_gguf")
        header = gguf_files.read_path(upload_path)
        if kind == "lora":
            gguf_files.check_lora(header, gguf_files.read_path(_embedded_path(svc)))
        else:
            _check_weights(upload_path, header)
        now = svc.clock.now()
        version_id = new_id("mv", now)
        final = upload_path.with_name(f"{version_id}.gguf")
        row = store.VersionRow(
            id=version_id,
            org_id=principal.org_id,
            project_id=project_id,
            type=kind,
            base=base.id,
            name=name,
            bytes=size,
            sha256=sha256_of(upload_path),
            file=final.name,
            architecture=str(header.architecture),
            created_at=now,
            deleted_at=None,
        )
        os.replace(upload_path, final)
        try:
            svc.db.transact_sync(lambda c: store.create_version(c, row))
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        kept = True
    finally:
        if not kept:
            upload_path.unlink(missing_ok=True)
    log.info(
        "model version uploaded",
        extra={
            "event": "model_version_uploaded",
            "version_id": version_id,
            "org_id": principal.org_id,
            "type": kind,
            "bytes": size,
        },
    )
    return version_view(row)


# -- reading and deleting -----------------------------------------------------------


def _visible(
    c: Connection, principal: Principal, project_id: str, version_id: str
) -> store.VersionRow:
    project_store.get_project(c, principal.org_id, project_id)
    row = store.get_version(c, version_id, org_id=principal.org_id)
    if row is None or row.project_id != project_id:
        raise NotFound(
            f"model version {version_id} not found", param="version_id", code="model_not_found"
        )
    return row


async def get(
    svc: Service, principal: Principal, project_id: str, version_id: str
) -> dict[str, Any]:
    row = await svc.db.read(lambda c: _visible(c, principal, project_id, version_id))
    return version_view(row)


async def list_views(svc: Service, principal: Principal, project_id: str) -> list[dict[str, Any]]:
    def load(c: Connection) -> list[store.VersionRow]:
        project_store.get_project(c, principal.org_id, project_id)
        return store.list_versions(c, principal.org_id, project_id)

    return [version_view(r) for r in await svc.db.read(load)]


async def org_versions(svc: Service, org_id: str) -> list[ModelSpec]:
    """Every live version of ``org_id``, known to this process's catalog from now on.

    Versions this process knew that the store no longer has (deleted through
    another process) are forgotten here, and their memory freed.
    """
    rows = await svc.db.read(lambda c: store.list_versions(c, org_id))
    live = {r.id for r in rows}
    for known in svc.catalog.visible(org_id):
        if known.organization == org_id and known.id not in live:
            await _forget(svc, known.id)
    found: list[ModelSpec] = []
    for r in rows:
        await resolve(svc, r.id)
        spec = svc.catalog.find(r.id, org_id)
        if spec is not None:
            found.append(spec)
    return found


async def resolve(svc: Service, model_id: object) -> None:
    """Bring this process's catalog up to the store's word on an ``mv.…`` name, off the loop.

    A known name is checked (one read by key: one deleted through another process is
    forgotten, so the door answers 404); an unknown one is read on a thread, with its own
    tokenizer (full weights), where ``Catalog.find`` would read it on the event loop."""
    if not isinstance(model_id, str) or not model_id.startswith(PROJECT_VERSION_PREFIX):
        return
    if model_id in svc.catalog.models:
        if not await svc.db.read(lambda c: store.get_version(c, model_id) is not None):
            await _forget(svc, model_id)
        return
    fetch = fetcher(svc.db, svc.catalog, folder_of(svc))
    got = await asyncio.to_thread(fetch, model_id)
    if got is None or model_id in svc.catalog.models:
        return
    spec, extras = got
    svc.catalog.add_version(spec, extras)
    if spec.tokenizer.startswith("gguf:"):
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            await asyncio.to_thread(svc.tokenizer, spec)


async def _forget(svc: Service, version_id: str) -> None:
    """Stop serving a version in this process: its engines free it, the catalog drops it."""
    for route in svc.catalog.routes_for(version_id):
        await svc.engines.forget_version(route, version_id)
    svc.catalog.remove_version(version_id)


def gate(db: Database, catalog: Catalog) -> Callable[[str], Awaitable[bool]]:
    """Whether a project version is still served: its row, read by key, is not deleted.

    The engine asks before each use of a version and at each idle sweep, so a
    delete through any process of the deployment is seen by all of them. Names
    that are not project versions (a config file's versions) always pass.
    """

    async def live(name: str) -> bool:
        if not name.startswith(PROJECT_VERSION_PREFIX):
            return True
        row = await db.read(lambda c: store.get_version(c, name))
        if row is None:
            catalog.remove_version(name)
            log.info(
                "model version deleted elsewhere, forgotten here",
                extra={"event": "model_version_forgotten", "id": name},
            )
            return False
        return True

    return live


async def delete(
    svc: Service, principal: Principal, project_id: str, version_id: str
) -> dict[str, Any]:
    """Delete a version and its file; refused while a run that names it is still live."""
    now = svc.clock.now()

    def tx(c: Connection) -> store.VersionRow:
        row = _visible(c, principal, project_id, version_id)
        users = store.live_runs_using(c, principal.org_id, version_id, tuple(TERMINAL))
        if users:
            raise Conflict(
                f"model version {version_id} is the model of run {users[0]}, which is still "
                "live; cancel it or wait until it ends",
                param="version_id",
                code="model_version_in_use",
            )
        store.mark_deleted(c, version_id, now)
        return row

    row = await svc.db.transact(tx)
    await _forget(svc, version_id)
    (folder_of(svc) / row.file).unlink(missing_ok=True)
    log.info("model version deleted", extra={"event": "model_version_deleted", "id": version_id})
    return {"id": version_id, "object": "model_version", "deleted": True}


# -- serving ------------------------------------------------------------------------------


def _spec(row: store.VersionRow, base: ModelSpec, path: Path) -> ModelSpec:
    return ModelSpec(
        id=row.id,
        # Billed at its base's prices: the same engine does the same work.
        input_per_mtok=base.input_per_mtok,
        output_per_mtok=base.output_per_mtok,
        context_window=base.context_window,
        modality=base.modality,
        # A LoRA keeps its base's vocabulary; full weights count with their own.
        tokenizer=base.tokenizer if row.type == "lora" else f"gguf:{path}",
        type="version",
        base_model=base.id,
        max_output_tokens=base.max_output_tokens,
        description=f"{row.name}: a {'LoRA adapter on' if row.type == 'lora' else 'fine-tune of'} "
        f"{base.id}, uploaded into project {row.project_id}",
        created=int(row.created_at.timestamp()),
        owned_by=row.org_id,
        organization=row.org_id,
        project_id=row.project_id,
    )


def fetcher(
    db: Database, catalog: Catalog, folder: Path
) -> Callable[[str], tuple[ModelSpec, dict[str, Any]] | None]:
    """The catalog's look-up of an unseen ``mv.…`` name: the stored version and its file.

    One read of the row by key; the file's checksum is the engine's to check,
    on its loading thread, when it loads the file (hashing gigabytes of
    weights here would stall whoever looked the name up).
    """

    def fetch(model_id: str) -> tuple[ModelSpec, dict[str, Any]] | None:
        row = db.read_sync(lambda c: store.get_version(c, model_id))
        if row is None:
            return None
        base = catalog.models.get(row.base)
        if base is None:
            return None
        path = folder / row.file
        key = "lora_path" if row.type == "lora" else "model_path"
        return _spec(row, base, path), {key: str(path), "sha256": row.sha256}

    return fetch


def discard_spool(f: IO[bytes]) -> None:
    """Close and remove an upload's temporary file (a refused or broken upload)."""
    with contextlib.suppress(OSError):
        f.close()
    name = getattr(f, "name", None)
    if isinstance(name, str):
        Path(name).unlink(missing_ok=True)
