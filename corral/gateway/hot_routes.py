"""The hottest routes (exec, fncall, create) dispatched straight from the ASGI stack, past FastAPI's router.

Why: on an exec of ``true`` a CPU profile of the server put more than half of a request's time in FastAPI's matching
(every included router's routes in turn), its dependency solving and its middleware around the route; dispatched
here, the server's CPU per exec went from 1.01-1.17 to 0.87-0.91 ms (docs/spec.md, Load). A hot route is still
declared as a FastAPI route (the OpenAPI document, and the same endpoint function); here its path is matched with
that route's own regex, the caller is authenticated by the same dependency, the endpoint called with the request,
its path parameters and what else it declares of these two: the caller (the parameter that depends on ``Auth``) and
one JSON body model (parsed by pydantic's core as FastAPI would read it, ``json_model_body``); a model it returns is
written as FastAPI writes a route's response model, with the route's status code; an error is answered by the app's
own exception handlers. So a request gets the same answer either way. ``hot_route`` checks that a route declares
nothing else (no query, header or other dependency) and depends on ``Auth`` once.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from corral.gateway.routes.deps import Auth

__all__ = ["HotRoute", "HotRoutes", "hot_route", "json_model_body"]

Endpoint = Callable[..., Awaitable[Response | BaseModel]]


class HotRoute:
    """One declared route served here: its method, its path's regex, its endpoint and what the endpoint takes."""

    def __init__(self, route: APIRoute, caller: str | None, body: tuple[str, type[BaseModel]] | None) -> None:
        self.route = route
        self.methods = frozenset(route.methods or ())
        self.endpoint: Endpoint = route.endpoint
        self.authenticate = Auth.dependency
        self.caller = caller  # the endpoint's parameter that takes the authenticated caller, if it has one
        self.body = body  # (parameter, model) of the endpoint's JSON body, if it has one
        model = route.response_model
        self.response_model = model if isinstance(model, type) and issubclass(model, BaseModel) else None
        self.status_code = route.status_code or 200

    def response(self, result: Response | BaseModel) -> Response:
        """The endpoint's answer: a Response as it is; an instance of the route's response model as FastAPI's JSON."""
        if isinstance(result, Response):
            return result
        if self.response_model is None or type(result) is not self.response_model:
            raise TypeError(f"{self.endpoint.__qualname__} returned {type(result).__name__}, not its response model")
        return Response(result.model_dump_json(), status_code=self.status_code, media_type="application/json")


def hot_route(routes: Sequence[Any], endpoint: Endpoint) -> HotRoute:
    """The declared route of ``endpoint`` among ``routes``, checked to be one this dispatch serves the same way."""
    found = [route for route in routes if isinstance(route, APIRoute) and route.endpoint is endpoint]
    if len(found) != 1:
        raise ValueError(f"{endpoint.__qualname__} is declared by {len(found)} routes, not one")
    route = found[0]
    dependant = route.dependant
    if [dependency.call for dependency in dependant.dependencies] != [Auth.dependency]:
        raise ValueError(f"the route of {endpoint.__qualname__} must depend on Auth alone, once")
    caller = dependant.dependencies[0].name  # None when the route, not a parameter, depends on Auth
    body = None
    if dependant.body_params:
        field = dependant.body_params[0]
        model = field.field_info.annotation
        if len(dependant.body_params) != 1 or not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ValueError(f"{endpoint.__qualname__} must take one JSON body model at most")
        body = (field.name, model)
    if dependant.query_params or dependant.header_params or dependant.cookie_params:
        raise ValueError(f"{endpoint.__qualname__} takes query, header or cookie parameters: not a hot route")
    wanted = ["request", *route.param_convertors, *([caller] if caller else []), *([body[0]] if body else [])]
    parameters = list(inspect.signature(endpoint).parameters)
    if sorted(parameters) != sorted(wanted):
        raise ValueError(f"{endpoint.__qualname__} takes {parameters}: a hot endpoint takes only {wanted}")
    return HotRoute(route, caller, body)


async def json_model_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as ``model``, read as FastAPI reads a route's body model (what it parses as JSON: a JSON media
    type, an empty body missing), by pydantic's core in one step; a mismatch is FastAPI's 422, located under
    ``body``."""
    raw = await request.body()
    try:
        if not raw:
            raise RequestValidationError(
                [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
            )
        if _json_media_type(request.headers.get("content-type")):
            return model.model_validate_json(raw)
        return model.model_validate(raw)  # FastAPI validates a body of another type as its bytes: refused
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc


def _json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json`` (parameters aside), as FastAPI decides to parse a body."""
    if not content_type:
        return False
    kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


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
    async def _serve(hot: HotRoute, params: dict[str, Any], scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = hot.route  # what the router would have set: RequestTiming counts by its template
        scope["path_params"] = params
        request = Request(scope, receive)
        try:
            caller = await hot.authenticate(request)
            arguments = dict(params)
            if hot.caller is not None:
                arguments[hot.caller] = caller
            if hot.body is not None:
                arguments[hot.body[0]] = await json_model_body(request, hot.body[1])
            response = hot.response(await hot.endpoint(request=request, **arguments))
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
