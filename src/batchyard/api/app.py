"""The app factory: one FastAPI app over one ``Service``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from batchyard.api import account, batches, chat, decide, models, projects, runs
from batchyard.api.errors import install_error_handlers
from batchyard.service import Service
from batchyard.web import routes as workspace

__all__ = ["create_app"]


def create_app(service: Service, *, worker: bool = True, close_on_exit: bool = True) -> FastAPI:
    """The app; ``close_on_exit=False`` leaves closing the service to its owner (tests)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start(worker=worker)
        try:
            yield
        finally:
            if close_on_exit:
                await service.stop()
            else:
                await service.stop_workers()

    app = FastAPI(title="batchyard", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok = service.started
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    # One router per front door; each door adds its own line.
    app.include_router(account.router)
    app.include_router(batches.router)
    app.include_router(chat.router)
    app.include_router(decide.router)
    app.include_router(models.router)
    app.include_router(projects.router)
    app.include_router(runs.router)
    app.include_router(workspace.router)  # the Batches workspace pages (web/)
    return app
