"""The HTTP application: the API routes behind the bearer token; health, the web page and the
OpenAPI schema open, as gRPC leaves health checks open."""
from __future__ import annotations

from pathlib import Path

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from ..auth import Token
from ..logs import HEADER, REQUEST_ID, request_id
from ..registry import Registry
from ..service import InferenceService
from .calls import CallFailed
from .libretranslate import libretranslate_routes
from .native import native_routes

STATIC = Path(__file__).resolve().parent.parent / "static"


def create_app(service: InferenceService, registry: Registry, token: str = "") -> FastAPI:
    # The schema and its viewer's page are both at /docs (FastAPI's viewer would fetch its scripts
    # from a CDN, and the server promises to fetch nothing from outside): the schema is the JSON itself.
    app = FastAPI(title="gret-serve", summary="Translation and summarisation; the gRPC API over HTTP/JSON",
                  openapi_url="/docs", docs_url=None, redoc_url=None)
    app.add_exception_handler(CallFailed, lambda request, error: error.response())
    app.add_middleware(RequestIds)
    guard = [Depends(bearer(Token(token)))] if token else []
    app.include_router(libretranslate_routes(service, registry), dependencies=guard)
    app.include_router(native_routes(service), dependencies=guard)
    app.include_router(health_routes(service, registry))
    if (STATIC / "index.html").exists():
        @app.get("/", include_in_schema=False)
        async def page():
            return FileResponse(STATIC / "index.html")

        app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


class RequestIds:
    """ASGI middleware: each HTTP call runs under its request id (the client's X-Request-Id, else a
    new one; server/logs.py), which the service logs with and the response carries back."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id(dict(scope["headers"]).get(HEADER.encode(), b"").decode("latin-1"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), rid.encode())]
            await send(message)

        known = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(known)


def bearer(token: Token):
    async def check(request: Request) -> None:  # async: FastAPI runs a plain function on a worker thread
        if not token.allows(request.headers.get("authorization", "")):
            raise CallFailed(grpc.StatusCode.UNAUTHENTICATED, Token.REFUSAL)
    return check


def health_routes(service: InferenceService, registry: Registry):
    """Liveness (the process answers) apart from readiness (it takes work: not draining), for the
    server and per model, as grpc.health.v1 reports them."""
    router = APIRouter(prefix="/health", tags=["health"])

    @router.get("/live", summary="The process answers")
    async def live():
        return {"status": "live"}

    @router.get("/ready", summary="The server takes calls (503 while it drains)")
    async def ready():
        return readiness()

    @router.get("/ready/{model}", summary="This model is loaded and takes calls")
    async def model_ready(model: str):
        if model not in registry.pipelines:
            return JSONResponse({"status": "not found", "error": f"no model named {model!r}"}, 404)
        return readiness()

    def readiness():
        if service.draining:
            return JSONResponse({"status": "draining"}, 503)
        return {"status": "ready"}

    return router
