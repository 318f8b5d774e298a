"""The HTTP API (FastAPI on uvicorn): the app, its error mapping and its routes.

The routes live in corral/gateway/routes, one module per resource; handlers stay thin: every request is
validated into a model of corral.api before it reaches a service, and every CorralError becomes its status
with a ``{"error": {"code", "message"}}`` body. The OpenAPI document is served at /openapi.json.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import DBAPIError

from corral.api.errors import CorralError, InvalidRequest
from corral.gateway.e2b import include_e2b
from corral.gateway.e2b.network import InternetEgress
from corral.gateway.hot_routes import HotRoutes, hot_route
from corral.gateway.request_timing import RequestTiming
from corral.gateway.route_table import install_route_table
from corral.gateway.routes import admin, commands, events, files, fncall, images, sandboxes, system, trajectory
from corral.gateway.sandbox_fusion import include_sandbox_fusion
from corral.images.bases import TOOLCHAIN_IMAGE
from corral.state.db import database_unreachable, unreachable_error

__all__ = ["create_app"]

DASHBOARD_DIR = Path(__file__).with_name("dashboard")
# In this order: a route of an earlier router wins a path both match (images/import/{ref} before images/{ref}),
# and a request is matched against the routes before its own one by one: commands and files (the agent's hot
# path) come first, their paths are under /v1/sandboxes/{sandbox_id}/ and no other router's.
ROUTERS = (commands, files, system, fncall, images, sandboxes, admin, events, trajectory)
_ERROR_RESPONSES = {
    status: {"description": description}
    for status, description in [
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown sandbox, image or path"),
        (409, "wrong state"), (410, "the sandbox ended"), (413, "payload too large"), (503, "no capacity"),
    ]
}  # fmt: skip


def create_app(  # type: ignore[no-untyped-def]
    service_factory,
    max_file_bytes: int,
    upload_dir: Path,
    *,
    internet_egress: InternetEgress = "public",
    sandbox_fusion_open: bool = False,
    sandbox_fusion_image: str = TOOLCHAIN_IMAGE,
) -> FastAPI:
    """``service_factory`` is an async context manager yielding the Services; ``internet_egress`` is what an
    E2B internet grant gives (CORRAL_INTERNET_EGRESS); ``sandbox_fusion_*``: CORRAL_SANDBOX_FUSION_OPEN and _IMAGE."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with service_factory() as service:
            app.state.service = service
            yield

    app = FastAPI(title="Corral", version="0.1.0", lifespan=lifespan, responses=_ERROR_RESPONSES)  # type: ignore[arg-type]
    app.state.max_file_bytes = max_file_bytes  # routes/deps.py: uploads within the limit
    app.state.upload_dir = upload_dir
    for module in ROUTERS:
        app.include_router(module.router)
    # Added first, so inside RequestTiming (the later added is the outer): a hot route's request is timed too.
    hot = [
        hot_route(commands.router.routes, commands.exec_command),
        hot_route(fncall.router.routes, fncall.fncall),
        hot_route(sandboxes.router.routes, sandboxes.create_sandbox),
    ]
    app.add_middleware(HotRoutes, routes=hot)
    app.add_middleware(RequestTiming)

    @app.exception_handler(CorralError)
    async def corral_error(_request: Request, exc: CorralError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status)

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        """The state database gone (a restart): a retryable 502 naming it, not a 500 with a traceback."""
        if not database_unreachable(exc):
            raise exc
        error = unreachable_error(exc)
        return JSONResponse(error.to_body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        error = InvalidRequest(f"invalid request: {problems}")
        return JSONResponse(error.to_body(), status_code=error.status)

    app.mount("/ui", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")

    @app.get("/", include_in_schema=False)
    async def dashboard_home() -> RedirectResponse:
        """The web dashboard (corral/gateway/dashboard): it asks for the key and uses this same API."""
        return RedirectResponse("/ui/")

    include_e2b(
        app, max_file_bytes, internet_egress
    )  # E2B's API and envd protocol on the same port (corral/gateway/e2b)
    # SandboxFusion's /run_code and /run_jupyter (corral/gateway/sandbox_fusion.py)
    include_sandbox_fusion(app, open_access=sandbox_fusion_open, toolchain_image=sandbox_fusion_image)
    install_route_table(app)  # every route found with one regex each (corral/gateway/route_table.py)
    return app
