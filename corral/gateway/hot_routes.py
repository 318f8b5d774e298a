"""The hottest routes (exec, fncall) dispatched straight from the ASGI stack, past FastAPI's router.

Why: on an exec of ``true`` a CPU profile of the server put more than half of a request's time in FastAPI's matching
(every included router's routes in turn), its dependency solving and its middleware around the route; dispatched
here, the server's CPU per exec went from 1.01-1.17 to 0.87-0.91 ms (docs/spec.md, Load). A hot route is still
declared as a FastAPI route (the OpenAPI document, and the same endpoint function); here its path is matched with
that route's own regex, the caller is authenticated by the same dependency, the endpoint called with the request
and its path parameters, and an error answered by the app's own exception handlers, so a request gets the same
answer either way. An endpoint listed here takes the request and its path parameters and nothing else
(``hot_route`` checks), and its route depends on ``Auth`` only.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from corral.gateway.routes.deps import Auth

__all__ = ["HotRoute", "HotRoutes", "hot_route"]

Endpoint = Callable[..., Awaitable[Response]]


class HotRoute:
    """One declared route served here: its method, its path's regex and its endpoint."""

    def __init__(self, route: APIRoute) -> None:
        self.route = route
        self.methods = frozenset(route.methods or ())
        self.endpoint: Endpoint = route.endpoint
        self.authenticate = Auth.dependency


def hot_route(routes: Sequence[Any], endpoint: Endpoint) -> HotRoute:
    """The declared route of ``endpoint`` among ``routes``, checked to be one this dispatch serves the same way."""
    found = [route for route in routes if isinstance(route, APIRoute) and route.endpoint is endpoint]
    if len(found) != 1:
        raise ValueError(f"{endpoint.__qualname__} is declared by {len(found)} routes, not one")
    route = found[0]
    wanted = ["request", *route.param_convertors]
    parameters = list(inspect.signature(endpoint).parameters)
    if sorted(parameters) != sorted(wanted):
        raise ValueError(f"{endpoint.__qualname__} takes {parameters}: a hot endpoint takes only {wanted}")
    if [dependency.dependency for dependency in route.dependencies] != [Auth.dependency]:
        raise ValueError(f"the route of {endpoint.__qualname__} must depend on Auth alone")
    return HotRoute(route)


class HotRoutes:
    """ASGI middleware: a request for a hot route is answered here, any other goes on to the app."""

    def __init__(self, app: ASGIApp, routes: Sequence[HotRoute]) -> None:
        self.app = app
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            for hot in self.routes:
                match = hot.route.path_regex.match(path)
                if match is not None and method in hot.methods:
                    await self._serve(hot, match.groupdict(), scope, receive, send)
                    return
        await self.app(scope, receive, send)

    @staticmethod
    async def _serve(hot: HotRoute, params: dict[str, str], scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = hot.route  # what the router would have set: RequestTiming counts by its template
        scope["path_params"] = params
        request = Request(scope, receive)
        try:
            await hot.authenticate(request)
            response = await hot.endpoint(request=request, **params)
        except Exception as exc:
            handler = _handler_for(scope["app"], exc)
            if handler is None:
                raise  # ServerErrorMiddleware's 500, logged, as for any route
            response = await handler(request, exc)
        await response(scope, receive, send)


def _handler_for(app: FastAPI, exc: Exception) -> Callable[[Request, Exception], Awaitable[Response]] | None:
    """The app's exception handler for ``exc``, found as Starlette's ExceptionMiddleware finds it (by the MRO)."""
    for cls in type(exc).__mro__:
        handler = app.exception_handlers.get(cls)
        if handler is not None:
            return handler  # type: ignore[return-value]
    return None
