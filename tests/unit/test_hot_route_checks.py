"""hot_route takes only endpoints the hot dispatch serves as FastAPI would: the request, its path parameters, the
caller and one JSON body model, a route that depends on Auth alone, once; the app's own three are such."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel

from corral.api.models import CreateSandboxRequest, SandboxInfo
from corral.gateway.app import create_app
from corral.gateway.hot_routes import HotRoutes, hot_route
from corral.gateway.request_timing import RequestTiming
from corral.gateway.routes import commands, fncall, sandboxes
from corral.gateway.routes.deps import Auth, CallerDep


class Thing(BaseModel):
    name: str


def test_the_apps_hot_endpoints_are_accepted() -> None:
    exec_route = hot_route(commands.router.routes, commands.exec_command)
    assert exec_route.route.path == "/v1/sandboxes/{sandbox_id}/exec" and exec_route.methods == {"POST"}
    assert exec_route.route.path_regex.match("/v1/sandboxes/sb-e0-1/exec").groupdict() == {"sandbox_id": "sb-e0-1"}
    assert exec_route.route.path_regex.match("/v1/sandboxes/sb-e0-1/exec/stream") is None
    assert hot_route(fncall.router.routes, fncall.fncall).route.path == "/v1/fncall"
    create = hot_route(sandboxes.router.routes, sandboxes.create_sandbox)
    assert (create.route.path, create.methods, create.status_code) == ("/v1/sandboxes", {"POST"}, 201)
    assert (create.caller, create.body, create.response_model) == (
        "caller",
        ("body", CreateSandboxRequest),
        SandboxInfo,
    )


def test_the_app_serves_exec_fncall_and_create_through_the_hot_dispatch(tmp_path: Path) -> None:
    app = create_app(None, 1 << 20, tmp_path)
    hot = [middleware for middleware in app.user_middleware if middleware.cls is HotRoutes]
    assert len(hot) == 1
    served = {(route.route.path, *route.methods) for route in hot[0].kwargs["routes"]}
    assert served == {("/v1/sandboxes/{sandbox_id}/exec", "POST"), ("/v1/fncall", "POST"), ("/v1/sandboxes", "POST")}
    timed = [middleware.cls for middleware in app.user_middleware]
    assert timed.index(RequestTiming) < timed.index(HotRoutes)  # outside it: hot requests are timed too


def test_an_endpoint_that_needs_more_than_the_request_is_refused() -> None:
    router = APIRouter()

    @router.post("/things/{thing_id}", dependencies=[Auth])
    async def with_a_query(thing_id: str, request: Request, limit: int = Query(1)) -> Response:
        return Response()

    @router.post("/things/{thing_id}/pair", dependencies=[Auth])
    async def with_two_bodies(thing_id: str, request: Request, one: Thing, two: Thing) -> Response:
        return Response()

    @router.post("/things/{thing_id}/plain", dependencies=[Auth])
    async def without_the_request(thing_id: str) -> Response:
        return Response()

    @router.post("/things/{thing_id}/named", response_model=None)
    async def with_caller_and_body(thing_id: str, request: Request, who: CallerDep, thing: Thing) -> Response:
        return Response()

    with pytest.raises(ValueError, match="query, header or cookie"):
        hot_route(router.routes, with_a_query)
    with pytest.raises(ValueError, match="one JSON body model"):
        hot_route(router.routes, with_two_bodies)
    with pytest.raises(ValueError, match="takes only"):
        hot_route(router.routes, without_the_request)
    accepted = hot_route(router.routes, with_caller_and_body)
    assert (accepted.caller, accepted.body, accepted.response_model) == ("who", ("thing", Thing), None)


def test_a_route_with_other_dependencies_is_refused() -> None:
    router = APIRouter()

    async def other() -> None:
        return None

    @router.post("/things/{thing_id}", dependencies=[Auth, Depends(other)])
    async def poke(thing_id: str, request: Request) -> Response:
        return Response()

    @router.post("/open/{thing_id}")
    async def unauthenticated(thing_id: str, request: Request) -> Response:
        return Response()

    @router.post("/twice/{thing_id}", dependencies=[Auth])
    async def twice(thing_id: str, request: Request, caller: CallerDep) -> Response:
        return Response()

    with pytest.raises(ValueError, match="Auth alone"):
        hot_route(router.routes, poke)
    with pytest.raises(ValueError, match="Auth alone"):
        hot_route(router.routes, twice)
    with pytest.raises(ValueError, match="Auth alone"):
        hot_route(router.routes, unauthenticated)
    with pytest.raises(ValueError, match="0 routes"):
        hot_route(router.routes, commands.exec_command)
