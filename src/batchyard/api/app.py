"""The app factory: one FastAPI app over one ``Service``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from batchyard.api import account, chat, models
from batchyard.api.errors import install_error_handlers
from batchyard.service import Service

__all__ = ["create_app"]


def create_app(service: Service, *, worker: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start(worker=worker)
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="batchyard", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        ok = service.started
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    for module in (account, chat, models):
        app.include_router(module.router)
    return app
